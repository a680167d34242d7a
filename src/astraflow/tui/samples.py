"""Turning a stored trajectory into readable text: token runs split by the loss mask, each decoded
with the policy's tokenizer and labelled with the versions that produced it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from astraflow.state.views import Sample

Decode = Callable[[list[int]], str]


@dataclass
class Segment:
    """A run of consecutive tokens with the same mask value."""

    trained: bool
    """True: the policy generated these tokens and trains on them (mask 1)."""
    tokens: list[int]
    versions: list[int]
    text: str = ""


def segments(sample: Sample, decode: Decode | None = None) -> list[Segment]:
    """The sample's mask runs in order (prompt, completion, and for multi-turn every turn)."""
    out: list[Segment] = []
    for tok, mask, ver in zip(sample.tokens, sample.loss_mask, sample.versions, strict=False):
        if not out or out[-1].trained != bool(mask):
            out.append(Segment(trained=bool(mask), tokens=[], versions=[]))
        out[-1].tokens.append(tok)
        out[-1].versions.append(ver)
    for seg in out:
        seg.text = decode(seg.tokens) if decode is not None else " ".join(str(t) for t in seg.tokens)
    return out


def version_span(versions: list[int]) -> str:
    """'v3' or 'v3..v5' over the versions that generated tokens ('-' for none)."""
    gen = [v for v in versions if v >= 0]
    if not gen:
        return "-"
    lo, hi = min(gen), max(gen)
    return f"v{lo}" if lo == hi else f"v{lo}..v{hi}"


def load_decoder(model_dir: str) -> Decode | None:
    """The policy's tokenizer as a decode function (None when the directory has no tokenizer)."""
    import os
    from pathlib import Path

    if not model_dir or not Path(model_dir).is_dir():
        return None
    fast = Path(model_dir) / "tokenizer.json"
    if fast.is_file():
        # the tokenizers library reads the same file in milliseconds; transformers takes seconds to import
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(fast))
        return lambda ids: str(raw.decode(ids, skip_special_tokens=False))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False))

    return decode

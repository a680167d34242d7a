"""Random-init transformers models with a locally built tokenizer, written fully offline.

The tokenizer is either the tiny word-level one of the quickstart tasks ("words") or a byte-level BPE
trained on a corpus file ("bpe", models/bpe.py) for text tasks.

`init_model` is what `astraflow model init` runs: it needs no hub access, and the same seed
gives byte-identical weights, so a quickstart run is reproducible from the recipe alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from astraflow.errors import AstraflowError

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Special tokens, in id order: pad = 0, bos = 1, eos = 2, unk = 3."""
WORDS: tuple[str, ...] = tuple(str(d) for d in range(10)) + ("copy", "reverse", "add", "+", "=")
"""Every other token: the digits and the words/symbols of the quickstart tasks."""


@dataclass(frozen=True)
class Preset:
    """Dimensions of one named model size."""

    hidden: int
    """Hidden size."""
    layers: int
    """Decoder layers."""
    heads: int
    """Attention heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Per-head dimension."""
    intermediate: int
    """MLP inner size."""
    vocab: int | None = None
    """Embedding rows; None = the tiny tokenizer's vocabulary."""
    max_positions: int = 512
    """Longest sequence the rotary embedding is configured for."""
    dtype: str = "float32"
    """dtype the weights are saved in."""
    tie: bool = True
    """Whether the output projection shares the embedding's weights."""


PRESETS: dict[str, dict[str, Preset]] = {
    "qwen3": {
        "tiny": Preset(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=192),
        "small": Preset(
            hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, intermediate=768, max_positions=2048
        ),
        # Qwen3-0.6B's real dimensions with random weights: for GPU benchmarks, never for learning.
        "0.6b-shape": Preset(
            hidden=1024,
            layers=28,
            heads=16,
            kv_heads=8,
            head_dim=128,
            intermediate=3072,
            vocab=151936,
            max_positions=40960,
            dtype="bfloat16",
        ),
        # Qwen3-1.7B's and Qwen3-4B's real dimensions (tied embeddings, as theirs), random weights.
        "1.7b-shape": Preset(
            hidden=2048,
            layers=28,
            heads=16,
            kv_heads=8,
            head_dim=128,
            intermediate=6144,
            vocab=151936,
            max_positions=40960,
            dtype="bfloat16",
        ),
        "4b-shape": Preset(
            hidden=2560,
            layers=36,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate=9728,
            vocab=151936,
            max_positions=40960,
            dtype="bfloat16",
        ),
        # Qwen3-8B's real dimensions (untied embeddings, as its), random weights: multi-GPU FSDP2 runs.
        "8b-shape": Preset(
            hidden=4096,
            layers=36,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate=12288,
            vocab=151936,
            max_positions=40960,
            dtype="bfloat16",
            tie=False,
        ),
    }
}
"""arch -> preset name -> dimensions."""


def build_tokenizer() -> Any:
    """The tiny word-level tokenizer as a transformers PreTrainedTokenizerFast (adds <bos> in front)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Digits are split one per token so "314" and "3 1 4" mean the same to the model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation(behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=4096,
    )


def _qwen3_config(p: Preset, vocab_size: int) -> Any:
    from transformers import Qwen3Config

    pad, bos, eos = 0, 1, 2
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim,
        max_position_embeddings=p.max_positions,
        tie_word_embeddings=p.tie,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
        dtype=p.dtype,
    )


def get_preset(arch: str, preset: str) -> Preset:
    """The dimensions of `preset` for `arch`, or an error listing what exists."""
    if arch not in PRESETS:
        raise AstraflowError(f"unknown model arch {arch!r}", hint=f"choose one of: {', '.join(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise AstraflowError(
            f"unknown preset {preset!r} for arch {arch!r}", hint=f"choose one of: {', '.join(PRESETS[arch])}"
        )
    return PRESETS[arch][preset]


def init_model(
    arch: str,
    preset: str,
    out: Path,
    seed: int = 0,
    tokenizer: str = "words",
    corpus: Path | None = None,
    vocab_size: int = 4096,
    device: str = "cpu",
) -> Path:
    """Write a random-init model directory (config, safetensors weights, generation config, tokenizer).

    tokenizer "words": the quickstart's word-level vocabulary; "bpe": a byte-level BPE of `vocab_size`
    tokens trained on `corpus`, with a chat template. device "cuda" initialises on the GPU (the 4B and
    8B shapes take minutes on a CPU); the weights are the same function of the seed on either device
    only in distribution, not bit for bit."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    p = get_preset(arch, preset)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AstraflowError(
            f"output path {out} exists and is not empty", hint="pick a new --out or remove it first"
        )
    tok = _build(tokenizer, corpus, vocab_size)
    config = _qwen3_config(p, p.vocab if p.vocab is not None else len(tok))
    dtype = getattr(torch, p.dtype)
    # Fork the global RNG so initialising a model never perturbs the caller's random stream.
    on_gpu = device.startswith("cuda")
    with torch.random.fork_rng(devices=[torch.device(device)] if on_gpu else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _build(kind: str, corpus: Path | None, vocab_size: int) -> Any:
    if kind == "words":
        if corpus is not None:
            raise AstraflowError("--corpus is only used with --tokenizer bpe", hint="add --tokenizer bpe")
        return build_tokenizer()
    if kind == "bpe":
        if corpus is None:
            raise AstraflowError("--tokenizer bpe needs a corpus", hint="pass --corpus FILE (UTF-8 text)")
        from astraflow.models.bpe import build_bpe_tokenizer

        return build_bpe_tokenizer(corpus, vocab_size)
    raise AstraflowError(f"unknown tokenizer {kind!r}", hint="choose one of: words, bpe")


def count_parameters(arch: str, preset: str) -> int:
    """Parameters of a preset, computed on the meta device (nothing is materialised)."""
    from transformers import AutoModelForCausalLM

    p = get_preset(arch, preset)
    vocab_size = p.vocab if p.vocab is not None else len(SPECIAL_TOKENS) + len(WORDS)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_qwen3_config(p, vocab_size))
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total

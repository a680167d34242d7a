"""Tool-aware SFT: chat rows with tools and tool calls rendered by a real chat template (the BPE
tokenizer of `astraflow model init`), the loss mask checked token by token, and a short run that
lowers the loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from astraflow.trainers.sft import SFTError, encode_row, read_rows, run_sft
from astraflow.workflows.env_protocol.reference import LOOKUP_TOOL, sft_rows


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sfttools")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(json.dumps(r) for r in sft_rows(16)) + "\n")
    subprocess.run(
        [sys.executable, "-m", "astraflow", "model", "init", "--arch", "qwen3", "--preset", "tiny"]
        + ["--tokenizer", "bpe", "--corpus", str(corpus), "--vocab-size", "320", "--out", str(d / "m")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return d / "m"


def _tok(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_tool_rows_mask_token_by_token(bpe_model: Path) -> None:
    tok = _tok(bpe_model)
    assert tok.chat_template and "tool_calls" in tok.chat_template
    row = sft_rows(1)[0]
    ex = encode_row(tok, row, 4096)
    # the ids are the template's rendering of the whole conversation, tools listed
    full = tok.apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in row["messages"]],
        tools=row["tools"],
        tokenize=False,
    )
    assert tok.decode(ex.ids) == full
    assert '"name": "lookup"' in tok.decode(ex.ids[: ex.mask.index(1)])  # the tools block is context
    # trained runs: exactly the two assistant turns, each through its <eos>; nothing else
    runs: list[list[int]] = []
    for k, (t, m) in enumerate(zip(ex.ids, ex.mask, strict=True)):
        if m:
            if k == 0 or not ex.mask[k - 1]:
                runs.append([])
            runs[-1].append(t)
    eos = tok.eos_token
    assert [tok.decode(r) for r in runs] == [
        '<tool_call>{"name": "lookup", "arguments": {"key": "k0"}}</tool_call>' + eos,
        "apple" + eos,
    ]
    # the tool result is context: every token of the tool block has mask 0
    text_upto = ""
    for k, t in enumerate(ex.ids):
        text_upto += tok.decode([t])
        if text_upto.endswith("<|im_start|>tool\napple"):
            assert ex.mask[k] == 0
            break
    else:
        raise AssertionError("no tool block")
    start = tok.decode(ex.ids).index("<|im_start|>tool")
    ctx = tok.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if not m])
    assert "<|im_start|>tool\napple" + eos in ctx and start > 0


def test_arguments_as_objects_or_strings_render_the_same(bpe_model: Path) -> None:
    tok = _tok(bpe_model)
    row = sft_rows(1)[0]
    obj = json.loads(json.dumps(row))
    call = obj["messages"][2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    assert encode_row(tok, obj, 4096) == encode_row(tok, row, 4096)


def test_bad_tool_rows_are_clear_errors(bpe_model: Path, tmp_path: Path) -> None:
    tok = _tok(bpe_model)
    bad = [
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, "content"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x", "tool_calls": []},
                    {"role": "assistant", "content": ""},
                ]
            },
            "assistant messages only",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"x": 1}}]}]},
            "function",
        ),
        ({"messages": [{"role": "assistant", "content": "a"}], "tools": [{"type": "function"}]}, "'tools'"),
    ]
    for row, match in bad:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(SFTError, match=match):
            read_rows(path)
    # a template that ignores tools is refused instead of training on a prompt without them
    tok.chat_template = "{% for m in messages %}{{ m.content }}<eos>{% endfor %}"
    with pytest.raises(SFTError, match="does not render tools"):
        encode_row(tok, {"messages": [{"role": "assistant", "content": "a"}], "tools": [LOOKUP_TOOL]}, 64)


def test_short_tool_sft_lowers_the_loss(bpe_model: Path, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    data = tmp_path / "lookup.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in sft_rows(8)) + "\n")
    report = run_sft(bpe_model, data, tmp_path / "out", epochs=3, lr=3e-3, batch_size=2, max_length=512)
    assert report.examples == 8 and report.epoch_loss[-1] < 0.7 * report.epoch_loss[0]
    assert (tmp_path / "out" / "config.json").is_file()

"""SFT warm start: loss only on completion tokens, a real tiny model that learns, clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from astraflow.trainers.sft import SFTError, encode_row, run_sft
from astraflow.workflows.quickstart.workflow import make_sample


def _rows(seed: int, n: int) -> list[dict[str, str]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = make_sample("copy", [rng.randrange(10) for _ in range(2)], 2)
        out.append({"prompt": prompt, "completion": " " + answer})
    return out


def _completion_nll(model_dir: Path, rows: list[dict[str, str]]) -> float:
    """Mean negative log-likelihood of the completion tokens (<eos> included) under a model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            p = tok.encode(r["prompt"])
            c = tok.encode(r["completion"], add_special_tokens=False) + [tok.eos_token_id]
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0, :-1], -1)
            for i, t in enumerate(c):
                total -= float(logp[len(p) - 1 + i, t])
                count += 1
    return total / count


def test_sft_trains_completion_tokens_and_writes_a_model(tiny_model: Path, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    row = _rows(0, 1)[0]
    ex = encode_row(tok, row, 512)
    n_prompt = len(tok.encode(row["prompt"]))
    assert ex.mask == [0] * n_prompt + [1] * (len(ex.ids) - n_prompt) and ex.ids[-1] == tok.eos_token_id
    assert tok.decode(ex.ids[n_prompt:], skip_special_tokens=True).split() == row["completion"].split()

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(1, 48)))
    out = tmp_path / "warm"
    report = run_sft(tiny_model, data, out, epochs=6, lr=3e-3, batch_size=16)
    assert report.examples == 48 and report.steps == 18
    assert report.epoch_loss[-1] < 0.5 * report.epoch_loss[0], report.epoch_loss
    assert json.loads((out / "sft.json").read_text())["epoch_loss"] == report.epoch_loss
    # unseen rows: the written model predicts completions far better than the one it started from
    unseen = _rows(2, 16)
    before, after = _completion_nll(tiny_model, unseen), _completion_nll(out, unseen)
    assert after < 0.6 * before, (before, after)
    # --until-loss: the same run stops after the first epoch at or under the bound (here epoch 3's loss)
    bound = report.epoch_loss[2]
    first = next(i for i, x in enumerate(report.epoch_loss) if x <= bound) + 1
    short = run_sft(tiny_model, data, tmp_path / "short", epochs=50, lr=3e-3, batch_size=16, until_loss=bound)
    assert short.epoch_loss == report.epoch_loss[:first] and short.steps == 3 * first


def test_chat_rows_train_assistant_turns_only(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    msgs = [
        {"role": "user", "content": "copy 1 2"},
        {"role": "assistant", "content": "1 2"},
        {"role": "user", "content": "copy 3"},
        {"role": "assistant", "content": "3"},
    ]
    with pytest.raises(SFTError, match="no chat template"):
        encode_row(tok, {"messages": msgs}, 512)
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}= {{ m.content }}<eos>"
        "{% else %}{{ m.content }} {% endif %}{% endfor %}{% if add_generation_prompt %}= {% endif %}"
    )
    ex = encode_row(tok, {"messages": msgs}, 512)
    trained = [t for t, mk in zip(ex.ids, ex.mask, strict=True) if mk]
    assert tok.decode(trained, skip_special_tokens=True).split() == ["1", "2", "3"]
    assert trained.count(tok.eos_token_id) == 2
    context = [t for t, mk in zip(ex.ids, ex.mask, strict=True) if not mk]
    assert tok.decode(context).split() == ["copy", "1", "2", "=", "copy", "3", "="]


def test_sft_bad_input_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "copy 1 ="}\n')
    with pytest.raises(SFTError, match=r"bad.jsonl:1: expected"):
        run_sft(tiny_model, bad, tmp_path / "o1")
    with pytest.raises(SFTError, match="not found"):
        run_sft(tiny_model, tmp_path / "missing.jsonl", tmp_path / "o2")
    with pytest.raises(SFTError, match="no model directory"):
        run_sft(tmp_path, bad, tmp_path / "o3")
    assert not (tmp_path / "o1").exists()

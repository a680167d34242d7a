"""Trajectory exports carry the decoded text of each sequence and of each policy turn."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.pipeline import Pipeline
from astraflow.errors import AstraflowError
from astraflow.metrics.export import export
from astraflow.protocol.messages import Episode, SamplingParams, Sequence
from astraflow.state.store import Store


def _run(tmp_path: Path, model: str) -> tuple[Path, list[int], list[int]]:
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rec = Recipe(policy=[PolicyConfig(model=model, group_size=1)])  # type: ignore[arg-type]
    (run_dir / "recipe.resolved.json").write_text(json.dumps(rec.model_dump(mode="json")))
    tok = AutoTokenizer.from_pretrained(model) if Path(model).is_dir() else None
    prompt = list(tok.encode("copy 1 2")) if tok else [1, 2, 3]
    turn1 = list(tok.encode("1 2", add_special_tokens=False)) if tok else [4]
    turn2 = list(tok.encode("3", add_special_tokens=False)) if tok else [5]
    ctx = list(tok.encode("and", add_special_tokens=False)) if tok else [6]
    tokens = prompt + turn1 + ctx + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(ctx) + [1] * len(turn2)
    seq = Sequence(
        policy="main",
        tokens=tokens,
        loss_mask=mask,
        logprobs=[0.0] * len(tokens),
        versions=[-1 if m == 0 else 0 for m in mask],
        reward=1.0,
        sampling=SamplingParams(),
    )
    store = Store.open(run_dir / "state.db")
    Pipeline(rec.policy, store, seed=rec.run.seed).ingest(Buffer(store), 1, "k", [Episode(sequences=[seq])])
    store.close()
    return run_dir, tokens, mask


def test_decoded_text_and_turns(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    run_dir, tokens, mask = _run(tmp_path, str(tiny_model))
    path, n = export(run_dir, "trajectories", "csv", None)
    (row,) = list(csv.DictReader(open(path)))
    assert n == 1 and row["text"] == tok.decode(tokens)
    turns = json.loads(row["generated"])
    assert [t.split() for t in turns] == [["1", "2"], ["3"]]
    # without text: no tokenizer needed, no text columns
    path, _ = export(run_dir, "trajectories", "csv", tmp_path / "t.csv", text=False)
    (row,) = list(csv.DictReader(open(path)))
    assert "text" not in row and "generated" not in row


def test_a_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    run_dir, _, _ = _run(tmp_path, str(tmp_path / "gone"))
    with pytest.raises(AstraflowError, match="cannot load the tokenizer of policy 'main'") as err:
        export(run_dir, "trajectories", "csv", None)
    assert "--no-text" in err.value.hint
    assert export(run_dir, "trajectories", "csv", None, text=False)[1] == 1

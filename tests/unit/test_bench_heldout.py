"""The held-out side of `astraflow bench trl --heldout`: the generated corpus and its seed split, which
checkpoints of each system are found, and the held-out curves and times to TRL's final accuracy (with
the evaluator replaced by a table of accuracies: the real one runs in scripts/gpu_trl.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.bench import heldout
from astraflow.bench.trl import Side, format_heldout, heldout_curves
from astraflow.config.load import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_corpus_rows_are_right_sums_and_seeds_split() -> None:
    rows = heldout.corpus_rows({"task": "add", "length": 3}, 50)
    for r in rows:
        words = r["prompt"].split()
        assert words[0] == "add" and words[-1] == "="
        a, b = "".join(words[1:4]), "".join(words[5:8])
        assert r["completion"].split() == list(str(int(a) + int(b)))
    held = {s["prompt"] for s in heldout.samples({"task": "add", "length": 3}, 50, heldout.HELDOUT_SEED)}
    assert not held & {r["prompt"] for r in rows}


def _save(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    return d


def test_checkpoint_dirs_of_both_layouts(tmp_path: Path) -> None:
    a = tmp_path / "astraflow"
    for n in (10, 5, 20):
        _save(a / "checkpoints" / "main" / f"step-{n}")
    (a / "checkpoints" / "main" / "step-30").mkdir()  # incomplete: no weights
    t = tmp_path / "trl"
    for n in (5, 10):
        _save(t / f"checkpoint-{n}")
    assert [s for s, _ in heldout.checkpoint_dirs(a, "astraflow")] == [5, 10, 20]
    assert [s for s, _ in heldout.checkpoint_dirs(t, "trl")] == [5, 10]


def test_heldout_curves_and_time_to_trl_final(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # astraflow: 0.2 -> 0.5 (step 2, 12 s) -> 0.7 (step 4, 14 s); trl: 0.2 -> 0.4 (step 2, 20 s) ->
    # 0.5 (step 4, 30 s). TRL's final 0.5: astraflow reaches it at 12 s, TRL at 30 s.
    acc = {"astraflow/2": 0.5, "astraflow/4": 0.7, "trl/2": 0.4, "trl/4": 0.5}
    for side, n in (("astraflow", 2), ("astraflow", 4)):
        _save(tmp_path / side / "checkpoints" / "main" / f"step-{n}")
    for n in (2, 4):
        _save(tmp_path / "trl" / f"checkpoint-{n}")

    class FakeEvaluator:
        def __init__(self, base: Path, held: list[dict[str, Any]], **_: Any) -> None:
            assert len(held) == 8
            self.current = "start"

        def load(self, ckpt: Path) -> None:
            side = "trl" if ckpt.name.startswith("checkpoint") else "astraflow"
            self.current = f"{side}/{ckpt.name.rsplit('-', 1)[1]}"

        def accuracy(self) -> float:
            return acc.get(self.current, 0.2)

    monkeypatch.setattr(heldout, "Evaluator", FakeEvaluator)
    recipe = load_recipe(ROOT / "recipes/gpu/arith.toml", [])
    sides = [
        Side("astraflow", 20.0, 5.0, [0.1] * 4, step_s=[10.0, 12.0, 13.0, 14.0]),
        Side("trl", 40.0, 15.0, [0.1] * 4, step_s=[15.0, 20.0, 25.0, 30.0]),
    ]
    res = heldout_curves(recipe, tmp_path / "base", tmp_path, sides, 8, "cpu")
    assert res["curves"]["astraflow"] == [
        {"step": 0, "seconds": 0.0, "accuracy": 0.2},
        {"step": 2, "seconds": 12.0, "accuracy": 0.5},
        {"step": 4, "seconds": 14.0, "accuracy": 0.7},
    ]
    assert res["trl_final_accuracy"] == 0.5
    assert res["seconds_to_trl_final"] == {"astraflow": 12.0, "trl": 30.0}
    assert res["ratio"] == pytest.approx(0.4)
    text = format_heldout(res, "seed 0")
    assert "astraflow 12.0s, trl 30.0s, astraflow/trl 0.40x" in text
    assert any(line.split() == ["4", "14.0", "0.700", "30.0", "0.500"] for line in text.splitlines())

"""The held-out side of `astraflow bench trl --heldout`: the generated corpus and its seed split, which
checkpoints of each system are found, and the held-out curves and times to TRL's final accuracy (with
the evaluator replaced by a table of accuracies: the real one runs in scripts/gpu_trl.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.bench import heldout
from astraflow.bench.trl import Side, heldout_curves
from astraflow.bench.trl_tables import format_heldout
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


def test_pretrain_rounds_are_successive_slices_of_the_corpus(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real SFT rounds of 3 rows over a 5-row corpus: each round trains on the next slice (wrapping),
    and an unreachable target runs every round, then keeps the last round's model."""
    import json

    from astraflow.trainers import sft

    rows = heldout.corpus_rows({"task": "add", "length": 1}, 5)
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: list[list[str]] = []
    real = sft.run_sft

    def recording(model: Path, part: Path, out: Path, **kw: Any) -> Any:
        seen.append([json.loads(line)["prompt"] for line in part.read_text().splitlines()])
        return real(model, part, out, **kw)

    monkeypatch.setattr(sft, "run_sft", recording)
    lines: list[str] = []
    heldout.pretrain(
        tiny_model,
        data,
        tmp_path / "out",
        options={"task": "add", "length": 1},
        target=1.1,
        max_epochs=2,
        lr=1e-3,
        batch_size=2,
        device="cpu",
        validation=4,
        rows_per_round=3,
        say=lines.append,
    )
    prompts = [r["prompt"] for r in rows]
    assert seen == [prompts[0:3], prompts[3:5] + prompts[0:1]]
    assert [line.split(":")[0] for line in lines] == ["sft round 1", "sft round 2"]
    assert (tmp_path / "out" / "config.json").is_file()
    with pytest.raises(SystemExit, match="fewer than --rows-per-round 9"):
        heldout.pretrain(
            tiny_model,
            data,
            tmp_path / "out2",
            options={"task": "add", "length": 1},
            target=0.5,
            max_epochs=1,
            lr=1e-3,
            batch_size=2,
            device="cpu",
            rows_per_round=9,
        )

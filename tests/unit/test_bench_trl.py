"""`astraflow bench trl`: a clear error when TRL cannot be installed, and the summary of several seeds
(each side's steps to the reward target and reward over the last tenth, per seed and over the seeds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from astraflow.bench import trl as bench_trl
from astraflow.bench.trl import Side, last_tenth, reaching, run_bench
from astraflow.bench.trl_tables import aggregate, steps_ratio
from astraflow.errors import AstraflowError

ROOT = Path(__file__).resolve().parents[2]


def test_uninstallable_trl_is_a_clear_error_before_any_run(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No package index (and a release that does not exist): pip fails at once, offline.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("ASTRAFLOW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench"
    with pytest.raises(AstraflowError) as err:
        run_bench(
            ROOT / "recipes/quickstart/recipe.toml",
            [f'policy.model="{tiny_model}"'],
            out,
            steps=2,
            trl_version="0.0.0",
            trl_path=None,
            trl_threads=1,
            timeout_s=60,
        )
    assert "could not resolve trl==0.0.0" in str(err.value)
    assert "--trl-path" in (err.value.hint or "")
    assert not (out / "astraflow").exists()  # the astraflow side never started
    assert not (tmp_path / "cache" / "trl-0.0.0" / ".complete").exists()


def curve(steps: int, rise_at: int) -> list[float]:
    """A reward curve at 0.1 that jumps to 0.9 at step `rise_at` (1-based): its 5-step mean first
    reaches 0.8 at step rise_at + 4 (0 = never rises)."""
    return [0.9 if rise_at and i + 1 >= rise_at else 0.1 for i in range(steps)]


def test_reaching_and_last_tenth_by_hand() -> None:
    assert reaching(curve(40, 10), 0.8) == 14  # steps 10..14 are the first window all at 0.9
    assert reaching(curve(40, 0), 0.8) is None
    assert reaching([0.8] * 5, 0.8) == 5
    r = [float(i) for i in range(1, 31)]  # 30 steps: the last tenth is 28, 29, 30
    assert last_tenth(r) == pytest.approx(29.0)
    assert last_tenth([0.5, 0.7]) == pytest.approx(0.7)  # at least one step
    assert last_tenth([]) is None


def test_aggregate_over_seeds_by_hand() -> None:
    sides = [
        Side("astraflow", 10.0 + i, 8.0, curve(60, rise), cpu_s=20.0) for i, rise in enumerate((20, 30, 0))
    ]
    agg = aggregate([s.summary(0.8) for s in sides])
    assert agg["steps_to_target"] == [24, 34, None]
    assert (agg["seeds"], agg["reached"]) == (3, 2)
    st = agg["step_reaching"]
    assert st["mean"] == pytest.approx(29.0) and (st["min"], st["max"]) == (24, 34)
    assert st["std"] == pytest.approx(50**0.5)  # sample std of 24 and 34
    # last tenth (6 steps): 0.9, 0.9 and 0.1
    assert agg["reward_last_tenth"]["mean"] == pytest.approx((0.9 + 0.9 + 0.1) / 3)
    assert agg["wall_s"]["mean"] == pytest.approx(11.0)
    # an unreached seed leaves the ratio out rather than flattering the side
    theirs = aggregate([Side("trl", 1.0, 1.0, curve(60, 20)).summary(0.8) for _ in range(3)])
    assert steps_ratio(agg, theirs) is None
    ours = aggregate([Side("astraflow", 1.0, 1.0, curve(60, r)).summary(0.8) for r in (21, 26, 31)])
    assert steps_ratio(ours, theirs) == pytest.approx(30.0 / 24.0)


def test_seeds_run_one_pair_each_and_summarise(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--seeds runs astraflow then TRL per seed (each with that seed, in its own directory) and the
    summary holds every seed's steps to the target, each side's spread and the ratio of the means."""
    calls: list[tuple[str, Any, Path]] = []
    rise = {("astraflow", 0): 20, ("astraflow", 1): 26, ("trl", 0): 21, ("trl", 1): 23}

    def fake_astraflow(
        recipe: Path, overrides: list[str], run_dir: Path, timeout: float, workers: int
    ) -> Side:
        seed = int([o for o in overrides if o.startswith("run.seed=")][-1].split("=")[1])
        calls.append(("astraflow", seed, run_dir))
        return Side("astraflow", 5.0, 4.0, curve(50, rise["astraflow", seed]), cpu_s=9.0)

    def fake_trl(spec: dict[str, Any], path: Path, out_dir: Path, timeout: float) -> Side:
        calls.append(("trl", spec["seed"], out_dir))
        assert spec["output_dir"] == str(out_dir) and spec["steps"] == 50
        return Side("trl", 4.0, 3.0, curve(50, rise["trl", spec["seed"]]), cpu_s=6.0)

    monkeypatch.setattr(bench_trl, "astraflow_side", fake_astraflow)
    monkeypatch.setattr(bench_trl, "run_trl", fake_trl)
    trl_dir = tmp_path / "trl-pkgs"
    (trl_dir / "trl").mkdir(parents=True)
    out = tmp_path / "bench"
    summary = run_bench(
        ROOT / "recipes/quickstart/recipe.toml",
        [f'policy.model="{tiny_model}"'],
        out,
        steps=50,
        trl_version="1.16.0",
        trl_path=trl_dir,
        trl_threads=1,
        timeout_s=60,
        seeds=[0, 1],
    )
    assert [(side, seed) for side, seed, _ in calls] == [
        ("astraflow", 0),
        ("trl", 0),
        ("astraflow", 1),
        ("trl", 1),
    ]
    assert [d for _, _, d in calls] == [
        out / "seed-0" / "astraflow",
        out / "seed-0" / "trl",
        out / "seed-1" / "astraflow",
        out / "seed-1" / "trl",
    ]
    agg = summary["aggregate"]
    assert agg["astraflow"]["steps_to_target"] == [24, 30]
    assert agg["trl"]["steps_to_target"] == [25, 27]
    assert agg["astraflow"]["step_reaching"]["mean"] == pytest.approx(27.0)
    assert summary["ratio_steps"] == pytest.approx(27.0 / 26.0)
    assert summary["seeds"] == [0, 1] and json.loads((out / "bench.json").read_text())["seeds"] == [0, 1]
    table = summary["table"]
    assert "steps to 0.8, seed 1" in table and "1.038x" in table and "seeds reaching it" in table


def test_without_seeds_one_pair_runs_with_the_recipe_seed(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs: list[Path] = []

    def fake_astraflow(
        recipe: Path, overrides: list[str], run_dir: Path, timeout: float, workers: int
    ) -> Side:
        assert not any(o.startswith("run.seed=") for o in overrides)  # the recipe's own seed
        dirs.append(run_dir)
        return Side("astraflow", 5.0, 4.0, curve(30, 10), cpu_s=9.0)

    def fake_trl(spec: dict[str, Any], path: Path, out_dir: Path, timeout: float) -> Side:
        assert spec["seed"] == 0
        dirs.append(out_dir)
        return Side("trl", 4.0, 3.0, curve(30, 12), cpu_s=6.0)

    monkeypatch.setattr(bench_trl, "astraflow_side", fake_astraflow)
    monkeypatch.setattr(bench_trl, "run_trl", fake_trl)
    (tmp_path / "trl-pkgs" / "trl").mkdir(parents=True)
    out = tmp_path / "bench"
    summary = run_bench(
        ROOT / "recipes/quickstart/recipe.toml",
        [f'policy.model="{tiny_model}"'],
        out,
        steps=30,
        trl_version="1.16.0",
        trl_path=tmp_path / "trl-pkgs",
        trl_threads=1,
        timeout_s=60,
    )
    assert dirs == [out / "astraflow", out / "trl"]
    assert [s["step_reaching"] for s in summary["sides"]] == [14, 16]
    assert "reward last tenth" in summary["table"] and "0.88x" in summary["table"]  # 14 / 16 steps

"""`astraflow bench data` runs real recipes through `astraflow up` and compares them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.config.load import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "recipes" / "math-efficient-data" / "smoke"


def _bench(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "astraflow", "bench", "data", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.timeout(60)
def test_bench_data_missing_recipe_is_a_clean_error(tmp_path: Path) -> None:
    proc = _bench([str(tmp_path / "nope.toml"), "--out", str(tmp_path / "b")], 50)
    assert proc.returncode == 2
    assert "recipe not found" in proc.stderr and "hint:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.timeout(480)
def test_bench_data_seeds_runs_each_recipe_per_seed_and_aggregates(tiny_model: Path, tmp_path: Path) -> None:
    # One bench of two variants over two seeds covers the per-run bookkeeping, the per-seed ratios,
    # the aggregation and the data-stage counters (four real `up` runs, the costly part of this test).
    recipes = [SMOKE / "a-none.toml", SMOKE / "d-greso.toml"]
    out = tmp_path / "bench"
    args = [*map(str, recipes), "--set", f"policy.model={tiny_model}", "--out", str(out), "--json"]
    proc = _bench([*args, "--seeds", "3,5"], 470)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads(proc.stdout)
    assert summary == json.loads((out / "bench.json").read_text())
    assert summary["seeds"] == [3, 5]
    runs = summary["runs"]
    assert [(r["name"], r["seed"]) for r in runs] == [
        ("a-none", 3),
        ("a-none", 5),
        ("d-greso", 3),
        ("d-greso", 5),
    ]
    for r in runs:
        assert r["ok"] and r["error"] == "", r["error"]
        path = SMOKE / f"{r['name']}.toml"
        pol, steps = load_recipe(path).policy[0], load_recipe(path).run.steps
        assert r["steps"] == steps
        assert (
            r["trained"] == r["trained_fresh"] + r["replayed"] == steps * pol.batch_prompts * pol.group_size
        )
        assert r["generated"] >= r["trained_fresh"] + r["filtered"] + r["expired"]
        assert r["curve"] and r["reward_final"] is not None
        assert (Path(r["run_dir"]) / "metrics.jsonl").is_file()
        run_dir = Path(r["run_dir"])
        assert run_dir == out / r["name"] / f"seed-{r['seed']}"
        # The seed reached the run itself, not only the bench's bookkeeping.
        assert json.loads((run_dir / "recipe.resolved.json").read_text())["run"]["seed"] == r["seed"]
        assert r["mixed_end"] is not None and 0.0 <= r["mixed_end"] <= 1.0
    # Per-run ratios compare with the baseline run of the same seed.
    by = {(r["name"], r["seed"]): r for r in runs}
    for seed in (3, 5):
        b, a = by[("d-greso", seed)], by[("a-none", seed)]
        assert b["ratios"]["generated"] == b["generated"] / a["generated"]
        assert a["ratios"]["generated"] == 1.0
        assert b["stages"].get("data/greso/submitted", 0) > 0, b["stages"]
        assert not any(k.startswith("data/greso/") for k in a["stages"])

    variants = {v["name"]: v for v in summary["variants"]}
    assert list(variants) == ["a-none", "d-greso"]
    for name, v in variants.items():
        gens = [by[(name, s)]["generated"] for s in (3, 5)]
        assert (v["ok"], v["n"], v["seeds"]) == (2, 2, [3, 5])
        assert v["generated"]["mean"] == sum(gens) / 2
        assert (v["generated"]["min"], v["generated"]["max"]) == (min(gens), max(gens))
    a_mean = variants["a-none"]["generated"]["mean"]
    assert variants["d-greso"]["ratios"]["generated"] == (variants["d-greso"]["generated"]["mean"] / a_mean)

    err = proc.stderr.splitlines()
    assert sum(1 for ln in err if ln.startswith("[") and ": ok," in ln) == 4
    header = next(i for i, ln in enumerate(err) if ln.startswith("variant "))
    rows = [ln.split() for ln in err[header + 2 : header + 4]]
    assert [r[0] for r in rows] == ["a-none", "d-greso"]
    assert all(r[1] == "2/2" for r in rows)
    assert rows[0][2] == f"{a_mean:.0f}"
    assert any(ln.startswith("seeds 3, 5;") for ln in err)


@pytest.mark.timeout(60)
def test_bench_data_bad_seeds_is_a_clean_error(tmp_path: Path) -> None:
    proc = _bench([str(SMOKE / "a-none.toml"), "--seeds", "0,x", "--out", str(tmp_path / "b")], 50)
    assert proc.returncode == 2
    assert "bad --seeds" in proc.stderr and "hint:" in proc.stderr
    assert not (tmp_path / "b").exists()

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


@pytest.mark.timeout(180)
def test_bench_data_compares_two_smoke_variants(tiny_model: Path, tmp_path: Path) -> None:
    recipes = [SMOKE / "a-none.toml", SMOKE / "d-greso.toml"]
    out = tmp_path / "bench"
    proc = _bench(
        [*map(str, recipes), "--set", f"policy.model={tiny_model}", "--out", str(out), "--json"], 170
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads(proc.stdout)
    assert summary == json.loads((out / "bench.json").read_text())
    assert summary["baseline"] == "a-none"
    runs = {r["name"]: r for r in summary["runs"]}
    assert list(runs) == ["a-none", "d-greso"]
    for path in recipes:
        r = runs[path.stem]
        pol = load_recipe(path).policy[0]
        steps = load_recipe(path).run.steps
        assert r["ok"] and r["error"] == ""
        assert r["steps"] == steps
        assert (
            r["trained"] == r["trained_fresh"] + r["replayed"] == steps * pol.batch_prompts * pol.group_size
        )
        assert r["generated"] >= r["trained_fresh"] + r["filtered"] + r["expired"]
        assert r["curve"] and r["reward_final"] is not None
        assert (Path(r["run_dir"]) / "metrics.jsonl").is_file()
    assert runs["a-none"]["ratios"]["generated"] == 1.0
    assert (
        runs["d-greso"]["ratios"]["generated"] == runs["d-greso"]["generated"] / runs["a-none"]["generated"]
    )
    greso = runs["d-greso"]["stages"]
    assert greso.get("data/greso/submitted", 0) > 0, greso
    assert not any(k.startswith("data/greso/") for k in runs["a-none"]["stages"])

    # The human side goes to stderr: one progress line per run, then the table with a row per recipe.
    err = proc.stderr.splitlines()
    assert sum(1 for ln in err if ln.startswith("[") and ": ok," in ln) == 2
    header = next(i for i, ln in enumerate(err) if ln.startswith("variant "))
    rows = [ln.split() for ln in err[header + 2 : header + 4]]
    assert [r[0] for r in rows] == ["a-none", "d-greso"]
    for r in rows:
        assert r[1] == str(runs[r[0]]["steps"]) and r[2] == str(runs[r[0]]["generated"])


@pytest.mark.timeout(60)
def test_bench_data_missing_recipe_is_a_clean_error(tmp_path: Path) -> None:
    proc = _bench([str(tmp_path / "nope.toml"), "--out", str(tmp_path / "b")], 50)
    assert proc.returncode == 2
    assert "recipe not found" in proc.stderr and "hint:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists()

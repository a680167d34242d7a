"""`astraflow bench e2e`: one short quickstart run through `astraflow up`, reported as samples/s, busy
fractions and weight-sync time per step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(360)  # its subprocesses have their own, longer limits
def test_bench_e2e_reports_throughput_busy_fractions_and_weight_sync(
    tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    sets = {
        "policy.0.model": f'"{tiny_model}"',
        "run.steps": "20",  # a window long enough to hold weight pulls (publishing runs in the background)
        "rollout.local_workers": "1",
        "policy.0.batch_prompts": "4",
        "policy.0.group_size": "4",
    }
    cmd = [sys.executable, "-m", "astraflow", "bench", "e2e", str(ROOT / "recipes/quickstart/recipe.toml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    out = subprocess.run(
        [*cmd, "--out", str(run_dir), "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rep = json.loads(out.stdout)
    assert rep == json.loads((run_dir / "e2e.json").read_text())
    pol = rep["policies"]["main"]
    assert pol["steps"] == 20 and rep["window_s"] > 0
    # 16 sequences a step: the 19 steps after the first were trained inside the window
    assert rep["trained_per_s"] == pytest.approx(19 * 16 / rep["window_s"])
    # rollouts buffered before the window (within the staleness bound) are not counted in it: >= 0
    assert rep["generated_per_s"] >= 0 and pol["generated_tokens_per_s"] >= pol["generated_per_s"]
    assert 0 < pol["trainer_busy"] <= 1 and pol["trainer_compute_s"] > 0
    sync = pol["weight_sync"]
    assert sync["publish_s"] > 0 and sync["fetch_s"] > 0 and sync["total_s"] >= sync["fetch_s"]
    eng = rep["workers"]["raas-0"]["engines"]["main"]
    # rollouts may all have finished before the window (two batches ahead): weight applies are inside it
    assert (
        0 < eng["busy"] <= 1 and eng["decode_rows_per_s"] >= 0 and eng["pulls"] >= 1 and eng["applied"] >= 1
    )
    # the apply's time splits into the copy and the running rows' KV recompute
    assert 0 <= eng["kv_recompute_s"] <= eng["apply_s"]
    lines = (run_dir / "logs/raas-0.stats.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["engines"]["main"]["version"] >= 2
    assert "weight sync per step" in out.stderr and "trainer busy" in out.stderr

"""PPO with GAE through `astraflow up`: the quickstart policy learns with `advantage = "gae"`, its value
model trains beside it (its loss and explained variance reach the metrics) and is checkpointed with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gae_run_learns_the_quickstart(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 60
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "up",
            str(ROOT / "recipes/quickstart/recipe.toml"),
            "--run-dir",
            str(run_dir),
            "--no-dash",
            "--set",
            f'policy.model="{tiny_model}"',
            "--set",
            'policy.advantage="gae"',
            "--set",
            f"run.steps={steps}",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    rewards = [r["reward_mean"] for r in recs]
    first = sum(rewards[:6]) / 6
    # the best 6-step window of the second half (a run at this lr may dip for a few steps and recover)
    last = max(sum(rewards[i : i + 6]) / 6 for i in range(steps // 2, steps - 5))
    print(f"gae quickstart: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.25, rewards
    # the value model trained: its metrics are there and it explains part of the returns by the end
    assert all("value_loss" in r and "value_explained_var" in r for r in recs)
    assert max(r["value_explained_var"] for r in recs[steps // 2 :]) > 0.1, [
        r["value_explained_var"] for r in recs
    ]
    ckpts = sorted((run_dir / "checkpoints" / "main").glob("step-*"))
    assert ckpts and (ckpts[-1] / "critic" / "critic.safetensors").is_file()

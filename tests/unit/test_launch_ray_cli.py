"""`astraflow launch ray` refuses a starting pool outside the autoscaler's bounds before it touches
the run directory or a Ray cluster (the run itself: tests/integration/test_launch_ray.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_starting_pool_outside_the_bounds_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "launch",
            "ray",
            str(ROOT / "recipes/quickstart/recipe.toml"),
            "--run-dir",
            str(run_dir),
            "--raas",
            "3",
            "--set",
            "rollout.autoscale.enabled=true",
            "--set",
            "rollout.autoscale.max=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "3 starting RaaS workers is outside rollout.autoscale.min..max (1..2)" in out.stderr
    assert "Traceback" not in out.stderr and not run_dir.exists()

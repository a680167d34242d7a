"""Local RaaS workers of `up`: one listed GPU each in turn, a member name per worker up to the autoscaler's max, and a starting pool within its bounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.launch.pool import worker_gpus

ROOT = Path(__file__).resolve().parents[2]


def test_several_workers_take_one_listed_gpu_each_in_turn() -> None:
    assert [worker_gpus("1,2,3", i, 3) for i in range(3)] == ["1", "2", "3"]
    assert [worker_gpus("0,1", i, 4) for i in range(4)] == ["0", "1", "0", "1"]


def test_one_worker_or_one_gpu_keeps_the_whole_list() -> None:
    assert worker_gpus("0,1", 0, 1) == "0,1"
    assert worker_gpus("0", 2, 3) == "0"
    assert worker_gpus("", 1, 2) == ""


def test_an_autoscaled_local_pool_has_a_name_per_worker_up_to_max_and_starts_within_bounds() -> None:
    from astraflow.config.recipe import RolloutConfig
    from astraflow.errors import AstraflowError
    from astraflow.launch.pool import check_bounds, pool_names

    fixed = RolloutConfig(local_workers=2)
    assert pool_names(fixed) == ["raas-0", "raas-1"]
    scaled = RolloutConfig(local_workers=1, autoscale={"enabled": True, "min": 1, "max": 3})
    assert pool_names(scaled) == ["raas-0", "raas-1", "raas-2"]
    check_bounds(scaled)
    outside = RolloutConfig(local_workers=4, autoscale={"enabled": True, "min": 1, "max": 3})
    with pytest.raises(
        AstraflowError, match=r"rollout.local_workers \(4\) is outside rollout.autoscale.min..max \(1..3\)"
    ):
        check_bounds(outside)


def test_up_refuses_a_starting_pool_outside_the_bounds_before_it_builds_anything(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "astraflow", "up", str(ROOT / "recipes/quickstart/recipe.toml"), "--no-dash"]
    cmd += ["--run-dir", str(tmp_path / "run"), "--set", "rollout.autoscale.enabled=true"]
    cmd += ["--set", "rollout.local_workers=3", "--set", "rollout.autoscale.max=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "rollout.local_workers (3) is outside rollout.autoscale.min..max (1..2)" in out.stderr
    # neither the run directory nor the recipe's model (policy.model_init) was made
    assert "Traceback" not in out.stderr and sorted(p.name for p in tmp_path.iterdir()) == []

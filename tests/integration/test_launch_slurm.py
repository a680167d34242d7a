"""`astraflow launch slurm` on a real single-node Slurm cluster: the quickstart runs as a batch job,
is cancelled mid-run, and the resubmitted script resumes it to its budget."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.slurm_local import LocalSlurm, skip_reason
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [int(r["step"]) for r in rows if "step" in r and r.get("kind") != "eval"]


def test_quickstart_through_launch_slurm_resumes_after_cancel(
    slurm: LocalSlurm, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "launch",
            "slurm",
            str(ROOT / "recipes/quickstart/recipe.toml"),
            "--run-dir",
            str(run_dir),
            "--nodes",
            "1",
            "--port",
            str(free_port()),
            "--set",
            f'policy.model="{tiny_model}"',
            "--set",
            "run.steps=30",
            "--set",
            "policy.checkpoint_every=2",
        ],
        capture_output=True,
        text=True,
        env=slurm.env,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.split("submitted job ")[1].split(":")[0]
    script = run_dir / "launch" / "slurm.sbatch"
    assert script.is_file() and (run_dir / "keys" / "members" / "raas-0.key_secret").is_file()
    # cancel the job once a checkpoint exists past step 2 (30 steps: it must still be running then)
    deadline = time.monotonic() + 300
    while max(_steps(run_dir), default=0) < 3:
        if slurm.job_state(job)[0] not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail("the job ended before its third step:\n" + slurm.report(job, run_dir))
        assert time.monotonic() < deadline, "the job made no progress:\n" + slurm.report(job, run_dir)
        time.sleep(0.1)
    subprocess.run(["scancel", job], check=True, env=slurm.env)
    assert slurm.wait_job(job, 120)[0] == "CANCELLED"
    before = _steps(run_dir)
    assert 3 <= max(before) < 30
    # resubmitting the same script resumes from state.db and the trainer's checkpoint
    again = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=slurm.env, check=True
    )
    job2 = again.stdout.strip().split(";")[0]
    state, code = slurm.wait_job(job2, 600)
    assert (state, code) == ("COMPLETED", "0:0"), slurm.report(job2, run_dir)
    steps = _steps(run_dir)
    assert sorted(set(steps)) == list(range(1, 31)), steps
    # resumed, not restarted: the steps done before the cancel are not all trained again
    assert len(steps) < len(before) + 30, steps

"""`astraflow launch slurm` with rollout.autoscale on a real single-node Slurm cluster: the job's pool
loop submits a one-RaaS job while work waits and drains a worker while the pool idles, with nothing lost
(every step once, every done task one group, no trajectory trained twice).

Each phase waits for what the run records, never for the clock (as test_up_autoscale.py does): the only
worker is stopped (SIGSTOP) while it holds a lease and tasks wait, so the run cannot move until the pool
has submitted a worker job; admission is then paused until a worker has been drained and left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.slurm_local import LocalSlurm, skip_reason
from tests.ports import free_port
from tests.run_checks import assert_run_intact, autoscale_sets, rows, stop_while_holding

ROOT = Path(__file__).resolve().parents[2]
STEPS = 32
pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "")


def _pool_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "pool.log"
    return path.read_text() if path.is_file() else ""


def _wait(what: str, cond: Callable[[], object], slurm: LocalSlurm, job: str, run_dir: Path) -> None:
    """Poll cond often (a phase of this run can last a second); ask Slurm about the job once a second."""
    deadline = time.monotonic() + 240
    asked = 0.0
    while not cond():
        if time.monotonic() - asked > 1.0:
            asked = time.monotonic()
            state = slurm.job_state(job)[0]
            if state not in ("PENDING", "RUNNING", "CONFIGURING"):
                pytest.fail(f"job {job} is {state} while waiting for {what}:\n{slurm.report(job, run_dir)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{_pool_log(run_dir)[-4000:]}")
        time.sleep(0.05)


def _ctl(slurm: LocalSlurm, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "astraflow", "ctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=slurm.env,
    )
    assert done.returncode == 0, done.stderr


# a controller, a trainer and up to two workers (one a job of its own) on two loaded cores
@pytest.mark.timeout(600)
def test_launch_slurm_adds_a_worker_job_while_work_waits_and_drains_one_while_idle(
    slurm: LocalSlurm, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    sets = autoscale_sets(tiny_model, STEPS)  # workers: the job's own step, then jobs the pool submits
    cmd = [sys.executable, "-m", "astraflow", "launch", "slurm", str(ROOT / "recipes/quickstart/recipe.toml")]
    cmd += ["--run-dir", str(run_dir), "--nodes", "1", "--raas", "1", "--port", str(free_port())]
    cmd += [a for s in sets for a in ("--set", s)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=slurm.env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.split("submitted job ")[1].split(":")[0]
    script = (run_dir / "launch" / "slurm.sbatch").read_text()
    assert "astraflow.cluster.slurm_pool" in script
    assert (run_dir / "launch" / "raas-1.sbatch").is_file()
    assert (run_dir / "keys" / "members" / "raas-1.key_secret").is_file()
    worker_job = ""
    try:
        # stop raas-0 (a step of the main job) at a moment it holds a lease while tasks wait
        pid = stop_while_holding(
            run_dir, lambda what, cond: _wait(what, cond, slurm, job, run_dir), env=slurm.env
        )
        _wait(
            "the pool to submit raas-1",
            lambda: "autoscale: added raas-1" in _pool_log(run_dir),
            slurm,
            job,
            run_dir,
        )
        worker_job = _pool_log(run_dir).split("autoscale: added raas-1 as job ")[1].split()[0]
        # admission is held from here until a drain is seen, so the run cannot end before it
        _ctl(slurm, "pause", "--run-dir", str(run_dir))
        os.kill(pid, signal.SIGCONT)
        steps = "SELECT COUNT(*) FROM metrics WHERE policy='main'"
        assert rows(run_dir, steps)[0][0] < STEPS, "the run was over before the pause"
        joined = "SELECT detail FROM events WHERE kind='member_joined'"
        _wait(
            "raas-1 to join",
            lambda: any(d.startswith("raas-1") for (d,) in rows(run_dir, joined)),
            slurm,
            job,
            run_dir,
        )
        _wait("a drain", lambda: "autoscale: draining" in _pool_log(run_dir), slurm, job, run_dir)
        drained = _pool_log(run_dir).split("autoscale: draining ")[1].split()[0]
        left = "SELECT detail FROM events WHERE kind='member_left'"
        _wait(
            f"{drained} to leave",
            lambda: any(d.startswith(drained) for (d,) in rows(run_dir, left)),
            slurm,
            job,
            run_dir,
        )
        _ctl(slurm, "resume", "--run-dir", str(run_dir))
        state = slurm.wait_job(job, 400)
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log*")))
        assert state == ("COMPLETED", "0:0"), logs
        assert slurm.wait_job(worker_job, 120) == ("COMPLETED", "0:0"), logs
    finally:
        for j in (job, worker_job):
            if j and slurm.job_state(j)[0] in ("PENDING", "RUNNING", "CONFIGURING"):
                subprocess.run(["scancel", j], env=slurm.env)
    pool = _pool_log(run_dir)
    if drained == "raas-1":  # the newest of equally idle workers: the job the pool submitted
        assert f"raas-1 (job {worker_job}) ended after its drain" in pool, pool
    else:
        assert f"{drained} (step pid" in pool and "ended after its drain" in pool, pool
    assert_run_intact(run_dir, STEPS, group=8)

"""`astraflow up` with rollout.autoscale: the launcher adds a local RaaS worker while work waits and
drains one while the pool idles, with nothing lost (every step once, every done task one group, no
trajectory trained twice).

Each phase waits for what the run records, never for the clock: the only worker is stopped (SIGSTOP)
while it holds a lease and tasks wait, so the run cannot move until the launcher has added a worker;
admission is then paused until a worker has been drained and left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.run_checks import assert_run_intact, autoscale_sets, rows, stop_while_holding

ROOT = Path(__file__).resolve().parents[2]
STEPS = 48  # long enough that a loaded machine still sees raas-0 holding a lease while tasks wait before the run ends


def _wait(what: str, cond: Callable[[], object], proc: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + 240
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"up exited {proc.returncode} while waiting for {what}:\n{out.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{out.read_text()[-4000:]}")
        time.sleep(0.2)


def _ctl(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "astraflow", "ctl", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# a controller, a trainer and up to two workers on two loaded cores: past the suite's 300 s default
@pytest.mark.timeout(600)
def test_up_adds_a_worker_while_work_waits_and_drains_one_while_idle(
    tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    sets = [*autoscale_sets(tiny_model, STEPS), "rollout.local_workers=1"]  # workers started by the launcher
    out = tmp_path / "up.out"
    cmd = [sys.executable, "-m", "astraflow", "up", str(ROOT / "recipes/quickstart/recipe.toml")]
    cmd += ["--run-dir", str(run_dir), "--no-dash", *[a for s in sets for a in ("--set", s)]]
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        pid = stop_while_holding(run_dir, lambda what, cond: _wait(what, cond, proc, out))
        _wait("the launcher to add raas-1", lambda: "autoscale: added raas-1" in out.read_text(), proc, out)
        # admission is held from here until a drain is seen, so the run cannot end before it: only the
        # tasks already leased can still finish once the worker goes on
        _ctl("pause", "--run-dir", str(run_dir))
        os.kill(pid, signal.SIGCONT)
        steps = "SELECT COUNT(*) FROM metrics WHERE policy='main'"
        assert rows(run_dir, steps)[0][0] < STEPS, "the run was over before the pause"
        _wait("a drain", lambda: "autoscale: draining" in out.read_text(), proc, out)
        drained = out.read_text().split("autoscale: draining ")[1].split()[0]
        left = "SELECT detail FROM events WHERE kind='member_left'"
        _wait(
            f"{drained} to leave",
            lambda: any(d.startswith(drained) for (d,) in rows(run_dir, left)),
            proc,
            out,
        )
        _ctl("resume", "--run-dir", str(run_dir))
        assert proc.wait(timeout=400) == 0, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    text = out.read_text()
    assert f"{drained} exited" not in text, "a drained worker was restarted as if it had failed"
    assert_run_intact(run_dir, STEPS, group=8)
    joined = [r[0] for r in rows(run_dir, "SELECT detail FROM events WHERE kind='member_joined'")]
    assert any(d.startswith("raas-1") for d in joined), joined

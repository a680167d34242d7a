"""`astraflow up` supervises real children: their command lines show their roles, and Ctrl-C, a
failing child or the launcher's own death leave no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def children_of_run(run_dir: Path) -> dict[int, str]:
    """pid -> command line of every astraflow process that names this run directory or its controller."""
    out = {}
    addr_file = run_dir / "controller.addr"
    addr = addr_file.read_text().strip() if addr_file.exists() else None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "astraflow" in cmd and (str(run_dir) in cmd or (addr and addr in cmd)) and " up " not in cmd:
            out[int(pid)] = cmd
    return out


def start_up(tiny_model: Path, run_dir: Path, steps: int = 500) -> subprocess.Popen[str]:
    return subprocess.Popen(
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
            f"run.steps={steps}",
            "--set",
            "rollout.local_workers=2",  # the quickstart runs one; supervision is checked with several
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_step(proc: subprocess.Popen[str], timeout: float = 120) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("[main] step "):
            return lines
    raise AssertionError("no progress line: " + "".join(lines[-30:]))


def wait_gone(pids: list[int], timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
        ]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


@pytest.mark.slow
def test_ctrl_c_stops_every_child_and_roles_show_in_ps(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_up(tiny_model, run_dir)
    try:
        wait_for_step(proc)
        kids = children_of_run(run_dir)
        cmds = list(kids.values())
        assert sum("join --role raas" in c for c in cmds) == 2, cmds
        assert sum("join --role trainer" in c for c in cmds) == 1, cmds
        assert sum(" controller " in c for c in cmds) == 1, cmds
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert wait_gone(list(kids)) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_killing_the_launcher_takes_its_children_down(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_up(tiny_model, run_dir)
    try:
        wait_for_step(proc)
        kids = children_of_run(run_dir)
        assert len(kids) == 4
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # each child stops on its own (SIGTERM from the kernel when its parent died): wait for that,
        # with a deadline that holds on a loaded machine
        left = wait_gone(list(kids), timeout=60)
        assert left == [], [kids[p] for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children_of_run(run_dir):  # a child that did not stop leaves no orphan behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def trainer_pids(run_dir: Path) -> list[int]:
    return [p for p, c in children_of_run(run_dir).items() if "--role trainer" in c]


@pytest.mark.slow
def test_killed_trainer_is_restarted_and_the_run_completes(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_up(tiny_model, run_dir, steps=12)
    try:
        wait_for_step(proc)
        os.kill(trainer_pids(run_dir)[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        assert "restarting it from its checkpoint" in out
        assert "[main] step 12/12" in out
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_trainer_that_keeps_dying_ends_the_run_with_its_log(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_up(tiny_model, run_dir)
    try:
        wait_for_step(proc)
        kids = children_of_run(run_dir)
        killed: set[int] = set()
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in trainer_pids(run_dir):
                if pid not in killed:
                    killed.add(pid)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert len(killed) == 3  # the first process and its two restarts
        assert "trainer-main failed" in out
        assert wait_gone(list(kids)) == []
    finally:
        if proc.poll() is None:
            proc.kill()

"""The suite's check for processes a test leaves running (tests/process_leaks.py), run on a pytest of
its own whose tests really leak: a child in a new session whose parent exited (reparented to init), a
fork, a module fixture's server never stopped; beside a test and a fixture that clean up, and a test
whose spawned worker leaves multiprocessing's resource tracker (one for the whole pytest process). Each
leak is named with its test (or fixture), its processes are killed, and the others are not named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.process_leaks import ON

ROOT = Path(__file__).resolve().parents[2]

INNER = """
import os, subprocess, sys, time
from pathlib import Path

import pytest

PIDS = Path(os.environ["LEAK_PIDS"])
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def record(name, pid):
    with PIDS.open("a") as f:
        f.write(f"{name} {pid}\\n")


@pytest.fixture(scope="module")
def forgotten_server():
    p = subprocess.Popen(SLEEP)
    record("fixture", p.pid)
    yield p  # never stopped


@pytest.fixture(scope="module")
def stopped_server():
    p = subprocess.Popen(SLEEP)
    yield p
    p.kill()
    p.wait()


def test_orphan_in_a_new_session():
    code = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(p.pid)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    record("orphan", int(out.stdout))


def test_fork():
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    record("fork", pid)


def test_spawn_leaves_only_the_resource_tracker():
    import multiprocessing as mp
    from multiprocessing import resource_tracker

    worker = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    worker.start()
    worker.join()
    record("tracker", resource_tracker._resource_tracker._pid)


def test_clean(stopped_server):
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_uses_the_server(forgotten_server):
    assert forgotten_server.poll() is None


def test_uses_the_server_again(forgotten_server, stopped_server):
    assert forgotten_server.poll() is None
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


@pytest.mark.skipif(not ON, reason="the check reads /proc (Linux only)")
def test_leaked_processes_are_named_with_their_test_and_killed(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.process_leaks"]\n')
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    pids = tmp_path / "pids"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "LEAK_PIDS": str(pids),
        "ASTRAFLOW_TEST_LEAKS": "error",
        "ASTRAFLOW_TEST_LEAK_GRACE_S": "0.2",
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    # output to a file: a process the check missed would hold a pipe open and hang the read
    with (tmp_path / "out.txt").open("w") as log:
        proc = subprocess.run(
            [*argv, "-c", os.devnull, str(tmp_path / "test_inner.py")],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=240,
        )
    out = (tmp_path / "out.txt").read_text()
    recorded = dict(line.split() for line in pids.read_text().splitlines())
    tracker = int(recorded.pop("tracker"))
    leaked = {name: int(pid) for name, pid in recorded.items()}
    try:
        assert proc.returncode == 1, out  # the leaking tests' teardowns fail in error mode
        summary = out[out.index("processes left running") :]
        assert "test_inner.py::test_orphan_in_a_new_session left 1 process(es)" in summary, out
        assert "test_inner.py::test_fork left 1 process(es)" in summary, out
        assert "fixture forgotten_server (module scope) left 1 process(es)" in summary, out
        for pid in leaked.values():
            assert f"pid {pid} " in summary, out
            assert not _alive(pid), f"pid {pid} was reported but is still running"
        assert "test_clean left" not in summary and "stopped_server" not in summary, out
        assert "test_uses_the_server left" not in summary, out
        # started once for the whole pytest process, and used by its later tests: not a leak
        assert "test_spawn_leaves_only_the_resource_tracker" not in summary, out
        assert f"pid {tracker} " not in out, out
        assert "6 passed" in out and "3 errors" in out, out
        assert "ERROR test_inner.py::test_uses_the_server_again" in out, out  # where the fixture ended
    finally:
        for pid in leaked.values():
            if _alive(pid):
                os.kill(pid, 9)

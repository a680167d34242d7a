"""`bench control --controller-cpu`: the controller runs alone on one CPU, every thread of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from astraflow.bench.wire import start_controller


def _thread_cpus(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


@pytest.mark.timeout(120)
def test_a_pinned_controller_keeps_every_thread_on_its_cpu(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one to pin to, one that must stay out")
    chosen = cpus[-1]
    proc, _ = start_controller(tmp_path, cpus={chosen})
    try:
        threads = _thread_cpus(proc.pid)
        # the serving controller has its loop thread and libzmq's I/O thread at least, all pinned
        assert len(threads) >= 2
        assert all(t == {chosen} for t in threads), threads
    finally:
        proc.kill()
        proc.wait()
    free, _ = start_controller(tmp_path / "free")
    try:
        assert any(len(t) > 1 for t in _thread_cpus(free.pid))  # unpinned: the test's check can fail
    finally:
        free.kill()
        free.wait()

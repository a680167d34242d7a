"""bench/threads.py: a process's CPU split by thread kind, read from /proc, on this very process."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from astraflow.bench import threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds  # CPU time of the process: stops after that much work
    while time.process_time() < end:
        pass


def _joined(worker: threading.Thread) -> None:
    """Join `worker` and wait until its thread has left /proc: join returns before the thread's last
    exit steps, and a thread id still listed can be the next test's new thread's (ids are reused)."""
    worker.join()
    task = f"/proc/{os.getpid()}/task/{worker.native_id}"
    deadline = time.monotonic() + 10
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_cpu_lands_on_the_thread_that_spent_it() -> None:
    before = threads.sample(os.getpid())
    _spin(0.3)  # on the main thread
    mid = threads.sample(os.getpid())
    worker = threading.Thread(target=_spin, args=(0.3,))
    worker.start()
    _joined(worker)
    after_worker = threads.sample(os.getpid())
    assert mid["main"] - before["main"] >= 0.2, (before, mid)
    # the worker ended before the last sample: its time is not in "other" and never in "main"
    assert after_worker["main"] - mid["main"] < 0.1, (mid, after_worker)
    assert after_worker["main_preempted"] >= before["main_preempted"]
    row = threads.per_step(before, mid, steps=3, window_s=1.0)
    assert row["main_ms_per_step"] is not None and row["main_ms_per_step"] >= 60, row


def test_a_running_worker_thread_counts_as_other() -> None:
    spent, stop = threading.Event(), threading.Event()

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.3:  # this thread's own CPU, however loaded the machine
            pass
        spent.set()
        stop.wait()  # alive (asleep) while the sample is taken: an ended thread is not counted

    before = threads.sample(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    try:
        assert spent.wait(60)
        after = threads.sample(os.getpid())
    finally:
        stop.set()
        _joined(worker)
    assert after["other"] - before["other"] >= 0.2, (before, after)
    assert after["main"] - before["main"] < after["other"] - before["other"], (before, after)


def test_a_gone_process_gives_nothing_and_no_split() -> None:
    assert threads.sample(2**22 + 12345) == {}
    assert threads.per_step({}, {"main": 1.0}, 3, 1.0)["main_ms_per_step"] is None


@pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"), reason="no schedstat"
)
def test_main_thread_time_is_read_to_the_millisecond_where_schedstat_exists() -> None:
    # the kernel's run time of this thread, the clock thread_time reads: a window of a few ms is read
    # as it was, not in 10 ms clock ticks. The main thread's reading is taken somewhere inside each
    # sample (which reads every thread of the process: milliseconds on a slow machine), so what it
    # spans lies between the busy window alone and the window with both samples around it.
    o0 = time.thread_time()
    before = threads.sample(os.getpid())
    i0 = time.thread_time()
    while time.thread_time() < i0 + 0.004:
        pass
    i1 = time.thread_time()
    after = threads.sample(os.getpid())
    o1 = time.thread_time()
    spent = after["main"] - before["main"]
    assert (i1 - i0) - 0.002 < spent < (o1 - o0) + 0.002, (spent, i1 - i0, o1 - o0)
    # clock ticks would make every reading a multiple of 10 ms
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert any(abs(v / tick - round(v / tick)) > 1e-3 for v in (before["main"], after["main"]))

"""A process's CPU per kind of thread, read from /proc (Linux): which of its threads spend a bench's
window. For the controller the kinds are its Python thread ("main", the one that handles every
message), libzmq's I/O threads ("zmq_io": reading, writing and CURVE's encryption of
every connection) and the rest ("other": the CURVE handshake's ZAP thread, libzmq's reaper, threads a
library starts). A thread's time is read from its schedstat (nanoseconds) where the kernel keeps
one, else from its stat in clock ticks (10 ms on most kernels: too coarse for a short window)."""

from __future__ import annotations

import os
from pathlib import Path


def _kind(pid: int, tid: int, comm: str) -> str:
    if tid == pid:
        return "main"
    if comm.startswith("ZMQbg/IO"):
        return "zmq_io"
    return "other"


def _cpu_s(base: Path, tick: int) -> float:
    """A thread's CPU seconds so far: schedstat's run time (ns), else stat's user + system ticks."""
    try:
        return int((base / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick


def sample(pid: int) -> dict[str, float]:
    """CPU seconds so far per kind of thread, and the main thread's involuntary context switches
    ("main_preempted": times the scheduler took its core from it for another runnable thread; with
    the controller pinned to one core, mostly its own other threads). Threads that ended before the
    call are not counted; {} when /proc cannot be read."""
    out = {"main": 0.0, "zmq_io": 0.0, "other": 0.0, "main_preempted": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for name in tids:
        base, tid = Path(f"/proc/{pid}/task/{name}"), int(name)
        try:
            cpu = _cpu_s(base, tick)
            comm = (base / "comm").read_text().strip()
            status = (base / "status").read_text() if tid == pid else ""
        except OSError:
            continue  # the thread ended between the listing and the read
        out[_kind(pid, tid, comm)] += cpu
        for line in status.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                out["main_preempted"] = float(line.split()[1])
    return out


def per_step(
    before: dict[str, float], after: dict[str, float], steps: int, window_s: float
) -> dict[str, float | None]:
    """The window's CPU milliseconds per step of each kind, and the main thread's preemptions a
    second (None where a sample was missing or no step was taken)."""
    if not before or not after:
        return {
            "main_ms_per_step": None,
            "zmq_io_ms_per_step": None,
            "other_ms_per_step": None,
            "main_preempted_per_s": None,
        }
    ms = {
        f"{k}_ms_per_step": (round(1000 * (after[k] - before[k]) / steps, 2) if steps else None)
        for k in ("main", "zmq_io", "other")
    }
    return {
        **ms,
        "main_preempted_per_s": round((after["main_preempted"] - before["main_preempted"]) / window_s, 1),
    }

"""`python -m astraflow.launch.service_guard -- COMMAND...`: how `astraflow up` runs a recipe's [[service]].

The guard leads the service's process group (up starts it in a session of its own) and runs the
command in it, so whatever the command starts shares the group. It takes the whole group down:
- when it gets SIGTERM or SIGINT: from `up` stopping the run, or from the kernel when `up` dies,
  even by SIGKILL (the guard asks for its parent's death signal; the command's own children could not
  be reached that way);
- when the command exits by itself: what it left running goes too.
Each time the group gets SIGTERM first and SIGKILL after GRACE_S. The guard exits with the
command's code (128 + N for a signal N). Processes that leave the group (setsid) are out of reach.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL to the group."""
_PR_SET_PDEATHSIG = 1


def _ask_for_parent_death_signal() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: `up` still stops the group on every exit but SIGKILL
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before the request took effect


def _take_down_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group (the guard itself ignores it), SIGKILL to what is left after GRACE_S."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # the command is gone (or past its grace); its leftovers get the rest of the grace, then SIGKILL
    while time.monotonic() < deadline and _others_in_group():
        time.sleep(0.05)
    if _others_in_group():
        try:
            os.killpg(0, signal.SIGKILL)  # the guard goes with them
        except ProcessLookupError:
            pass


def _others_in_group() -> bool:
    """Whether a live process other than the guard is in its process group (Linux /proc)."""
    me, group = os.getpid(), os.getpgrp()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # cannot tell: assume so, and SIGKILL
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields: state, ppid, pgrp, ...; a zombie is dead for this purpose
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def main(argv: list[str]) -> int:
    """Run the command after `--` and return its exit code (see the module docstring)."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m astraflow.launch.service_guard -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _ask_for_parent_death_signal()
    try:
        proc = subprocess.Popen(argv)
    except OSError as exc:
        print(f"error: cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        return 127
    while proc.poll() is None and not stop["signal"]:
        time.sleep(0.1)
    _take_down_group(proc)
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

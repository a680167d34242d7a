"""Ports for the services a test starts: free now, and outside the kernel's ephemeral range.

A port the kernel hands out for `bind(("", 0))` comes from the ephemeral range, the same range every
outgoing connection and every other `bind(0)` (srun's I/O ports, Ray's, a library's) draws from. A
test picks a port, then a process it starts binds it a second or more later: in that gap another
process's `bind(0)` may take it, and the service fails to start. Picking below the ephemeral range
leaves only other tests' own picks to collide with, and each is random and checked free."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20_000
"""Below this lie ports that system services commonly use, and Ray's worker ports (10002-19999 by
default: a raylet refuses to start when one of its own ports falls in that range)."""
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))  # any address: a service bound to 0.0.0.0 or 127.0.0.1 fits
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nothing listens on now, not handed out before by this process, below the
    ephemeral range when it leaves room (else one the kernel picks)."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1_000:
        for _ in range(200):
            port = random.randrange(_LOWEST, low)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _given.add(port)
    return port

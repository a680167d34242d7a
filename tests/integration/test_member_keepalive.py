"""A member's control connection to a controller host that vanished is dropped by the member's own
kernel: TCP keepalive and TCP_USER_TIMEOUT, set by `transport.server.member_keepalive` on the socket
`MemberClient` opens. Members send no ZMTP pings, so the controller's process has nothing to answer.

The fault is real: in a network namespace of its own (only a loopback device), the loopback goes
down under a live connection, so no segment reaches the controller's socket again and no RST comes
back, as when a host vanishes. The child shortens the keepalive's times (1 s idle, probes 1 s apart,
a 3 s timeout) so the test takes seconds rather than the real 30 s; without `member_keepalive` the
connection stays up (nothing is sent on it) and the test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
    reason="needs root with unshare and ip: the fault is a network namespace's loopback going down",
)

CHILD = textwrap.dedent(
    """
    import subprocess, time
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    from astraflow.protocol import messages as m
    from astraflow.transport import server
    from astraflow.transport.client import MemberClient

    server.MEMBER_KEEPALIVE_IDLE_S, server.MEMBER_KEEPALIVE_INTVL_S = 1, 1
    server.MEMBER_KEEPALIVE_CNT, server.MEMBER_TIMEOUT_MS = 2, 3000
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    hello = m.Hello(rid=1, member_id="raas-keepalive", role="raas", protocol=m.PROTOCOL_VERSION,
                    policies=["main"], slots=1, pid=1, host="h", hardware="cpu")
    sock = MemberClient(f"tcp://127.0.0.1:{port}", hello)._open_socket(ctx)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.send(b"up")
    assert router.poll(10_000), "the connection never came up"
    router.recv_multipart()
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
    t0 = time.monotonic()
    if monitor.poll(20_000):
        event = recv_monitor_message(monitor)["event"]
        print(f"{event.name} after {time.monotonic() - t0:.1f} s")
    else:
        print("still connected after 20 s")
    """
)


def test_connection_to_a_vanished_controller_host_is_dropped() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        ["unshare", "--net", "--", sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("DISCONNECTED after"), line
    # the 3 s timeout, not the 20 s the child waits: the kernel dropped it on the member's settings
    assert float(line.split()[2]) < 10.0, line

"""A member whose transport thread dies: its waiting requests fail at once, and the process exits 1
(so a supervisor restarts it) instead of hanging on replies that can no longer come."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import concurrent.futures, sys, time
    from astraflow.errors import ConnectError
    from astraflow.protocol.messages import PROTOCOL_VERSION, Hello, StatusRequest
    from astraflow.transport import member_loop
    from astraflow.transport.client import MemberClient

    def boom(self):
        raise RuntimeError("transport bug")

    member_loop.MemberLoop._heartbeat_or_hello = boom
    hello = Hello(member_id="raas-x", role="raas", protocol=PROTOCOL_VERSION, policies=["main"])
    client = MemberClient("tcp://127.0.0.1:9", hello, connect_timeout_s=600)
    client.exit_on_failure = sys.argv[1] == "exit"
    t0 = time.monotonic()
    try:
        client.connect()
    except ConnectError as exc:
        print("connect failed:", exc, flush=True)
    fut = client.submit(StatusRequest(), timeout_s=600)
    try:
        fut.result(60)
    except ConnectError as exc:
        print("request failed:", exc, flush=True)
    except concurrent.futures.TimeoutError:
        print("request hung", flush=True)
    time.sleep(60 if sys.argv[1] == "exit" else 0)
    """
)


@pytest.mark.chaos
@pytest.mark.parametrize("mode", ["exit", "stay"])
def test_a_dead_transport_thread_fails_requests_and_ends_the_member(mode: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if mode == "exit":
        assert out.returncode == 1, out.stdout + out.stderr
        assert "member transport thread failed" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        first = out.stdout.splitlines()[0]
        assert first.startswith("connect failed") and "transport thread failed" in first, out.stdout
        assert "request failed: member client is closed" in out.stdout, out.stdout + out.stderr

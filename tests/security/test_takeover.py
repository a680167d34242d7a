"""Without authentication, a live member's routing id cannot be taken over by another connection,
and a member whose id was squatted gets in on a new connection once the squatter is gone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from astraflow.protocol.codec import encode
from astraflow.protocol.messages import PROTOCOL_VERSION, Hello, StatusReply, StatusRequest, Welcome
from astraflow.transport.client import MemberClient
from astraflow.transport.server import RouterServer


class Echo:
    """A RouterServer that welcomes every Hello and answers StatusRequest with the sender's id."""

    def __init__(self) -> None:
        self.server = RouterServer("tcp://127.0.0.1:0")
        self.seen: list[tuple[bytes, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for ident, principal, msg in self.server.poll(20):
                assert principal is None
                self.seen.append((ident, type(msg).__name__))
                if isinstance(msg, Hello):
                    self.server.send(
                        ident, Welcome(rid=msg.rid, run_name="t", sections={}, heartbeat_interval_s=0.2)
                    )
                elif isinstance(msg, StatusRequest):
                    self.server.send(ident, StatusReply(rid=msg.rid, status={"pid": msg.rid}))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.close()


def _squatter(addr: str, ident: bytes) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, ident)
    s.connect(addr)
    return ctx, s


def _client(addr: str, name: str) -> MemberClient:
    hello = Hello(member_id=name, role="raas", protocol=PROTOCOL_VERSION)
    return MemberClient(addr, hello, heartbeat_interval_s=0.2, connect_timeout_s=20)


def test_a_live_members_id_cannot_be_taken_over(echo: Echo) -> None:
    real = _client(echo.server.address, "raas-1")
    try:
        real.connect()
        ctx, evil = _squatter(echo.server.address, b"raas-1")
        evil.send(encode(Hello(rid=99, member_id="raas-1", role="raas", protocol=PROTOCOL_VERSION)))
        evil.send(encode(StatusRequest(rid=98)))
        assert not evil.poll(1500), "the second connection under a live id got an answer"
        assert (b"raas-1", "StatusRequest") not in echo.seen  # nothing of it was delivered
        reply = real.request(StatusRequest(), timeout_s=5)  # the real member's route is intact
        assert isinstance(reply, StatusReply)
        evil.close(0)
        ctx.term()
    finally:
        real.close()


def test_a_squatted_id_is_regained_once_the_squatter_leaves(echo: Echo) -> None:
    ctx, squat = _squatter(echo.server.address, b"raas-2")
    squat.send(encode(StatusRequest(rid=1)))
    assert squat.poll(5000)  # the squatter holds the id now
    real = _client(echo.server.address, "raas-2")
    done: dict[str, Any] = {}
    t = threading.Thread(target=lambda: done.setdefault("welcome", real.connect()))
    t.start()
    time.sleep(2.0)
    assert "welcome" not in done  # ignored while the squatter's connection lives
    squat.close(0)
    ctx.term()
    t.join(25)
    try:
        # the client dialled again on a new connection after its Hello went unanswered
        assert isinstance(done.get("welcome"), Welcome)
    finally:
        real.close()

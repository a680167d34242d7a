"""RouterServer + MemberClient over real sockets on loopback, with a controller stand-in in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from astraflow.errors import ConnectError, ProtocolError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Msg,
    StatusReply,
    StatusRequest,
    TaskGrant,
    TaskRequest,
    VersionInfo,
    Welcome,
)
from astraflow.transport.client import MemberClient
from astraflow.transport.server import RouterServer


class StandIn:
    """A minimal controller: knows members only after Hello, answers unknown_member otherwise."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0", version: int = 1) -> None:
        self.server = RouterServer(bind, max_message_bytes=1 << 20)
        self.address = self.server.address
        self.version = version
        self.weights_addr = "tcp://w:1"
        self.known: set[bytes] = set()
        self.hellos: list[Hello] = []
        self.heartbeats: list[tuple[float, Heartbeat]] = []
        self.byes: list[Bye] = []
        self.decode_errors: list[DecodeError] = []
        self.stop_members = False
        self.silent = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _versions(self) -> list[VersionInfo]:
        return [VersionInfo(policy="p", version=self.version, weights_addr=self.weights_addr)]

    def _answer(self, ident: bytes, msg: Msg) -> Msg | None:
        if isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                return Error(rid=msg.rid, code="protocol_version", message="mismatch")
            self.known.add(ident)
            self.hellos.append(msg)
            return Welcome(
                rid=msg.rid, run_name="t", sections={}, heartbeat_interval_s=0, versions=self._versions()
            )
        if ident not in self.known:
            return Error(rid=msg.rid, code="unknown_member", message="who are you")
        if isinstance(msg, Heartbeat):
            self.heartbeats.append((time.monotonic(), msg))
            return HeartbeatAck(rid=msg.rid, versions=self._versions(), stop=self.stop_members)
        if isinstance(msg, Bye):
            self.byes.append(msg)
            self.known.discard(ident)
            return Ack(rid=msg.rid)
        if isinstance(msg, StatusRequest):
            return StatusReply(rid=msg.rid, status={"echo": ident.decode()})
        if isinstance(msg, TaskRequest):
            return TaskGrant(rid=msg.rid, retry_after_s=float(msg.n), versions=self._versions())
        return Error(rid=msg.rid, code="unknown_type", message=type(msg).__name__)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for ident, _principal, msg in self.server.poll(20):
                if isinstance(msg, DecodeError):
                    self.decode_errors.append(msg)
                    # what the controller answers an undecodable frame (roles/controller/service.py handle)
                    self.server.send(ident, Error(rid=msg.rid, code=msg.code, message=str(msg)[:500]))
                    continue
                reply = self._answer(ident, msg)
                if reply is not None and not self.silent:
                    self.server.send(ident, reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


@pytest.fixture
def standin() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.close()


def _client(addr: str, member: str = "m1", **kw: float) -> MemberClient:
    hello = Hello(member_id=member, role="raas", protocol=PROTOCOL_VERSION, policies=["p"])
    kw.setdefault("heartbeat_interval_s", 0.05)
    kw.setdefault("connect_timeout_s", 5.0)
    return MemberClient(addr, hello, **kw)  # type: ignore[arg-type]


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_request_reply_heartbeats_and_versions(standin: StandIn) -> None:
    c = _client(standin.address)
    seen: list[int] = []
    c.on_versions = lambda v: seen.append(v["p"].version)
    try:
        welcome = c.connect()
        assert welcome.run_name == "t"
        assert c.versions["p"].version == 1
        reply = c.request(StatusRequest(), timeout_s=5)
        assert isinstance(reply, StatusReply) and reply.status == {"echo": "m1"}
        # concurrent submits from several threads are each matched to their own reply
        futs = [c.submit(TaskRequest(n=i)) for i in range(20)]
        assert [f.result(5).retry_after_s for f in futs] == [float(i) for i in range(20)]  # type: ignore[attr-defined]
        c.set_load({"p": 1}, busy=2, free=6)
        assert _wait(
            lambda: any(h.busy == 2 and h.free == 6 and h.loaded == {"p": 1} for _, h in standin.heartbeats)
        )
        standin.version = 5
        assert _wait(lambda: c.versions["p"].version == 5)
        assert seen[-1] == 5
        # the same version re-announced at a new address (its trainer restarted) replaces the old one
        standin.weights_addr = "tcp://w:2"
        assert _wait(lambda: c.versions["p"].weights_addr == "tcp://w:2")
        assert c.versions["p"].version == 5
        standin.version = 4  # an older announcement never goes back
        # the grant carries version 4, and the client merges a reply's versions before it resolves it
        c.request(TaskRequest(n=1), timeout_s=5)
        assert c.versions["p"].version == 5
        assert not c.stop_requested
        standin.stop_members = True
        assert _wait(lambda: c.stop_requested)
    finally:
        c.close("test over")
    assert _wait(lambda: [b.reason for b in standin.byes] == ["test over"])


def test_garbage_frames_answered_and_server_survives(standin: StandIn) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(standin.address)
    try:
        raw.send(b"\xc1garbage")
        raw.send_multipart([b"a", b"b", b"c"])
        raw.send(msgspec.msgpack.encode({"type": "Unpickle", "rid": 33}))
        raw.send(encode(Hello(rid=34, member_id="x", role="raas", protocol=PROTOCOL_VERSION)))
        replies = []
        for _ in range(4):
            assert raw.poll(5000)
            replies.append(decode(raw.recv()))
        errors = [r for r in replies if isinstance(r, Error)]
        assert [e.code for e in errors] == ["bad_message", "bad_message", "unknown_type"]
        assert errors[2].rid == 33
        assert isinstance(replies[3], Welcome) and replies[3].rid == 34
        # a frame over the size limit drops that connection, not the server
        raw.send(b"\x00" * (2 << 20))
        time.sleep(0.2)
        c = _client(standin.address, "m2")
        try:
            c.connect()
            assert isinstance(c.request(StatusRequest(), timeout_s=5), StatusReply)
        finally:
            c.close()
        assert len(standin.decode_errors) == 3
    finally:
        raw.close(0)
        ctx.term()


def test_rehello_on_unknown_member(standin: StandIn) -> None:
    c = _client(standin.address)
    try:
        c.connect()
        standin.known.clear()  # the controller forgot the member
        reply = c.request(StatusRequest(), timeout_s=5)
        assert isinstance(reply, StatusReply)
        assert len(standin.hellos) == 2
        n = len(standin.heartbeats)
        assert _wait(lambda: len(standin.heartbeats) > n + 2)
    finally:
        c.close()


def test_reconnect_after_controller_restart_on_same_port() -> None:
    first = StandIn()
    addr = first.address
    c = _client(addr)
    try:
        c.connect()
        first.close()
        # while the controller is away, requests fail with a clear ConnectError
        with pytest.raises(ConnectError, match="did not answer StatusRequest"):
            c.request(StatusRequest(), timeout_s=0.5)
        second = StandIn(addr, version=9)
        try:
            assert _wait(lambda: len(second.hellos) == 1 and len(second.heartbeats) >= 2, 10)
            assert isinstance(c.request(StatusRequest(), timeout_s=5), StatusReply)
            assert c.versions["p"].version == 9
        finally:
            second.close()
    finally:
        c.close()


def test_hang_watchdog_stops_heartbeats(standin: StandIn) -> None:
    c = _client(standin.address, hang_timeout_s=0.4)
    try:
        c.connect()
        assert _wait(lambda: len(standin.heartbeats) >= 3)
        assert _wait(lambda: c.hung, 3)
        # a beat decided before the watchdog fired is ahead of this request on the one connection, and
        # the stand-in records messages in order: once it answered, every such beat has landed
        assert isinstance(c.request(StatusRequest(), timeout_s=5), StatusReply)
        n = len(standin.heartbeats)
        time.sleep(0.5)
        assert len(standin.heartbeats) == n
        c.tick()
        assert _wait(lambda: len(standin.heartbeats) > n + 2)
    finally:
        c.close()


def test_connect_timeout_and_refusal() -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(0)
    ctx.term()
    c = _client(f"tcp://127.0.0.1:{port}", connect_timeout_s=0.3)
    try:
        with pytest.raises(ConnectError, match="did not answer within 0.3s") as info:
            c.connect()
        assert "astraflow controller" in info.value.hint
    finally:
        c.close()
    standin = StandIn()
    hello = Hello(member_id="old", role="raas", protocol=PROTOCOL_VERSION + 1)
    old = MemberClient(standin.address, hello, connect_timeout_s=5)
    try:
        with pytest.raises(ProtocolError, match="protocol_version"):
            old.connect()
    finally:
        old.close()
        standin.close()


def test_a_leaving_member_never_joins_again(standin: StandIn) -> None:
    # the controller forgot the member before its Bye arrived (it drained it and marked it left): the
    # Bye is answered unknown_member, and the member must not answer that with a new Hello (a ghost
    # member the controller would count as alive until its timeout)
    c = _client(standin.address)
    c.connect()
    assert len(standin.hellos) == 1
    standin.known.clear()
    c.close("drained")
    # (without the rule, close() itself waits for the second Welcome to resend its Bye: the Hello is
    # recorded by the time it returns)
    assert len(standin.hellos) == 1 and not standin.byes

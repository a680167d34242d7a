"""A member's end of the control plane: one DEALER owned by a background thread, with heartbeats."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from astraflow import log
from astraflow.errors import ConnectError, ProtocolError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import (
    Bye,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Msg,
    TaskGrant,
    VersionInfo,
    Welcome,
)
from astraflow.transport.server import DEFAULT_MAX_MESSAGE_BYTES

_log = log.get("transport.client")

_HINT = "is `astraflow controller` running? check the address/port"


@dataclass
class _Pending:
    """A request sent (or waiting to be sent) and the future its reply resolves."""

    msg: Msg
    future: concurrent.futures.Future[Msg]
    deadline: float


class MemberClient:
    """Connects a member (RaaS, trainer, observer) to the controller and keeps it alive.

    All socket work happens on one background thread; submit() may be called from any thread.
    Heartbeats stop when the owner stops calling tick() for hang_timeout_s, so a hung process
    looks dead to the controller and its leases expire.
    """

    def __init__(
        self,
        controller: str,
        hello: Hello,
        *,
        heartbeat_interval_s: float = 0.5,
        hang_timeout_s: float = 30.0,
        connect_timeout_s: float = 20.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """Prepare the client; nothing is sent until connect()."""
        self.controller = controller
        """The controller endpoint this client connects to."""
        self.hello = hello
        self.heartbeat_interval_s = heartbeat_interval_s
        """Seconds between heartbeats; replaced by the Welcome's value when that is positive."""
        self.hang_timeout_s = hang_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.versions: dict[str, VersionInfo] = {}
        """Newest version per policy seen in any reply; replaced whole, so reads need no lock."""
        self.stop_requested = False
        """True once the controller said stop (HeartbeatAck or TaskGrant)."""
        self.on_versions: Callable[[dict[str, VersionInfo]], None] | None = None
        """Called on the transport thread when `versions` changes; must return quickly."""
        self.welcome: Welcome | None = None
        """The latest Welcome received."""
        self.last_heard: float = 0.0
        """time.monotonic() of the last message from the controller (0 = never)."""

        self._max_message_bytes = max_message_bytes
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._load: tuple[dict[str, int], int, int] = ({}, 0, 0)
        self._last_tick = time.monotonic()
        self._inbox: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._hello_future: concurrent.futures.Future[Msg] | None = None

    # ----- owner API ------------------------------------------------------------------------

    def connect(self) -> Welcome:
        """Send Hello and wait for Welcome; ConnectError on timeout, ProtocolError if refused."""
        self.tick()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="astraflow-member", daemon=True)
            self._thread.start()
        fut: concurrent.futures.Future[Msg] = concurrent.futures.Future()
        with self._lock:
            self._hello_future = fut
        self._wake()
        try:
            reply = fut.result(self.connect_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ConnectError(
                f"controller at {self.controller} did not answer within {self.connect_timeout_s:g}s",
                hint=_HINT,
            ) from None
        if isinstance(reply, Error):
            raise ProtocolError(
                f"controller at {self.controller} refused to join: {reply.code}: {reply.message}",
                hint="upgrade astraflow on this machine to match the controller"
                if reply.code == "protocol_version"
                else "check the member id, role and policies",
            )
        assert isinstance(reply, Welcome)
        return reply

    def submit(self, msg: Msg, timeout_s: float = 30.0) -> concurrent.futures.Future[Msg]:
        """Queue a request (assigns its rid); the future resolves with the rid-matched reply.

        The future fails with ConnectError if no reply comes within timeout_s, and with
        ConnectError at close(). An Error reply resolves it normally (it is a reply).
        """
        fut: concurrent.futures.Future[Msg] = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(ConnectError("member client is closed", hint="call connect() again"))
            return fut
        with self._lock:
            msg.rid = next(self._rids)
        self._inbox.put(_Pending(msg, fut, time.monotonic() + timeout_s))
        self._wake()
        return fut

    def request(self, msg: Msg, timeout_s: float = 30.0) -> Msg:
        """Send a request and wait for its reply; ConnectError on timeout."""
        fut = self.submit(msg, timeout_s)
        try:
            return fut.result(timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            raise self._timeout_error(msg, timeout_s) from None

    def set_load(self, loaded: dict[str, int], busy: int, free: int) -> None:
        """Set the load reported in the next Heartbeat."""
        with self._lock:
            self._load = (dict(loaded), busy, free)

    def tick(self) -> None:
        """Tell the watchdog the owner's loop is alive; call it at least every hang_timeout_s."""
        self._last_tick = time.monotonic()

    @property
    def hung(self) -> bool:
        """True while the owner has not called tick() within hang_timeout_s (heartbeats stop)."""
        return time.monotonic() - self._last_tick > self.hang_timeout_s

    def close(self, reason: str = "") -> None:
        """Say Bye (best effort, waits briefly for the Ack), stop the thread, close the socket."""
        if self._closed:
            return
        if self._thread is not None and self.welcome is not None:
            bye = self.submit(Bye(reason=reason), timeout_s=1.0)
            try:
                bye.result(1.5)
            except (concurrent.futures.TimeoutError, ConnectError):
                pass
        self._closed = True
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ----- transport thread -----------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is already full of wakeups, or closing

    def _timeout_error(self, msg: Msg, timeout_s: float) -> ConnectError:
        return ConnectError(
            f"controller at {self.controller} did not answer {type(msg).__name__} "
            f"within {timeout_s:g}s",
            hint=_HINT,
        )

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.hello.member_id.encode())
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        # queue only to a live connection: nothing stale piles up while the controller is away
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.connect(self.controller)
        try:
            _Loop(self, sock).run()
        except Exception:  # a crashed transport thread would otherwise look like a silent hang
            _log.exception("member transport thread failed")
        finally:
            sock.close(0)
            ctx.term()


class _Loop:
    """State of the transport thread: pending requests, the outbox and the join handshake."""

    def __init__(self, client: MemberClient, sock: zmq.Socket) -> None:
        self.c = client
        self.sock = sock
        self.pending: dict[int, _Pending] = {}
        self.outbox: deque[Msg] = deque()
        self.backlog: deque[_Pending] = deque()
        """Requests held while not joined (before Welcome, or after unknown_member)."""
        self.joined = False
        self.hello_rid = 0
        self.hello_sent = 0.0
        self.next_beat = 0.0
        self.hung_logged = False

    def run(self) -> None:
        c = self.c
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(c._wake_r, zmq.POLLIN)
        while not c._stopping.is_set():
            now = time.monotonic()
            wait = max(0.0, min(self.next_beat - now, 0.02 if self.outbox else 1.0))
            for target, _ in poller.poll(wait * 1000):
                if target == c._wake_r:
                    os.read(c._wake_r, 4096)
                else:
                    self._drain_socket()
            self._take_requests()
            self._heartbeat_or_hello()
            self._flush()
            self._expire()
        for p in list(self.pending.values()) + list(self.backlog):
            _fail(p.future, ConnectError("member client closed before the reply came", hint=""))
        while True:
            try:
                item = c._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _fail(item.future, ConnectError("member client closed", hint=""))

    # ----- outgoing ---------------------------------------------------------------------------

    def _take_requests(self) -> None:
        c = self.c
        with c._lock:
            hello_future, c._hello_future = c._hello_future, None
        if hello_future is not None:
            hello = c.hello
            hello.rid = self.hello_rid = next(c._rids)
            self.pending[hello.rid] = _Pending(hello, hello_future, float("inf"))
            self._send_hello()
        while True:
            try:
                item = c._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            if self.joined:
                self.pending[item.msg.rid] = item
                self.outbox.append(item.msg)
            else:
                self.backlog.append(item)

    def _send_hello(self) -> None:
        hello = self.c.hello
        if not self.hello_rid:
            hello.rid = self.hello_rid = next(self.c._rids)
        self.hello_sent = time.monotonic()
        # a re-sent Hello must be the only Hello in the outbox
        self.outbox = deque(m for m in self.outbox if not isinstance(m, Hello))
        self.outbox.appendleft(hello)

    def _heartbeat_or_hello(self) -> None:
        c = self.c
        now = time.monotonic()
        if now < self.next_beat:
            return
        self.next_beat = now + c.heartbeat_interval_s
        if c.hung:
            if not self.hung_logged:
                _log.warning("owner loop silent for %.0fs: heartbeats stopped", c.hang_timeout_s)
                self.hung_logged = True
            return
        self.hung_logged = False
        if not self.joined:
            # Hello lost on a dropped connection, or the controller came back: ask again
            if self.hello_rid and now - self.hello_sent > max(1.0, 2 * c.heartbeat_interval_s):
                self._send_hello()
            return
        loaded, busy, free = c._load
        beat = Heartbeat(rid=next(c._rids), loaded=loaded, busy=busy, free=free)
        # a heartbeat that cannot go out now is worthless later: replace any queued one
        self.outbox = deque(m for m in self.outbox if not isinstance(m, Heartbeat))
        self.outbox.append(beat)

    def _flush(self) -> None:
        while self.outbox:
            msg = self.outbox[0]
            try:
                self.sock.send(encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                return  # no live connection yet: retry on the next loop turn
            self.outbox.popleft()

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [rid for rid, p in self.pending.items() if p.deadline <= now]
        for rid in expired:
            p = self.pending.pop(rid)
            _fail(p.future, self.c._timeout_error(p.msg, 0.0 if p.deadline == 0 else _age(p, now)))
        if expired:
            dead = {id(p.msg) for p in self.pending.values()}
            self.outbox = deque(m for m in self.outbox if not _is_request(m) or id(m) in dead)
        kept: deque[_Pending] = deque()
        for p in self.backlog:
            if p.deadline <= now:
                _fail(p.future, self.c._timeout_error(p.msg, _age(p, now)))
            else:
                kept.append(p)
        self.backlog = kept

    # ----- incoming ---------------------------------------------------------------------------

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                _log.warning("ignored a reply of %d frames", len(frames))
                continue
            try:
                msg = decode(frames[0])
            except DecodeError as exc:
                _log.warning("ignored an undecodable reply: %s", exc)
                continue
            self.c.last_heard = time.monotonic()
            self._handle(msg)

    def _handle(self, msg: Msg) -> None:
        c = self.c
        if isinstance(msg, Error) and msg.code == "unknown_member":
            self._rejoin(msg.rid)
            return
        if isinstance(msg, Welcome):
            c.welcome = msg
            if msg.heartbeat_interval_s > 0:
                c.heartbeat_interval_s = msg.heartbeat_interval_s
            self._merge_versions(msg.versions)
            if msg.rid == self.hello_rid:
                self.joined = True
                self.hello_rid = 0
                self.next_beat = time.monotonic() + c.heartbeat_interval_s
                for p in self.backlog:
                    self.pending[p.msg.rid] = p
                    self.outbox.append(p.msg)
                self.backlog.clear()
        elif isinstance(msg, HeartbeatAck):
            self._merge_versions(msg.versions)
            c.stop_requested = c.stop_requested or msg.stop
            return
        elif isinstance(msg, TaskGrant):
            self._merge_versions(msg.versions)
            c.stop_requested = c.stop_requested or msg.stop
        p = self.pending.pop(msg.rid, None)
        if p is not None and not p.future.done():
            p.future.set_result(msg)
        elif p is None and not isinstance(msg, Welcome):
            _log.debug("late or unsolicited %s rid=%d", type(msg).__name__, msg.rid)

    def _rejoin(self, rid: int) -> None:
        """The controller forgot us (it restarted): Hello again and replay the rejected request."""
        p = self.pending.pop(rid, None)
        if p is not None and isinstance(p.msg, Hello):
            self.pending[rid] = p
            p = None
        if p is not None:
            self.backlog.appendleft(p)
        if self.joined:
            _log.info("controller at %s does not know us: joining again", self.c.controller)
            self.joined = False
            # requests already in flight will come back as unknown_member and join the backlog
        if not self.hello_rid or time.monotonic() - self.hello_sent > self.c.heartbeat_interval_s:
            self._send_hello()

    def _merge_versions(self, infos: list[VersionInfo]) -> None:
        c = self.c
        current = c.versions
        newer = {v.policy: v for v in infos if v.policy not in current or v.version > current[v.policy].version}
        if not newer:
            return
        c.versions = {**current, **newer}
        if c.on_versions is not None:
            try:
                c.on_versions(c.versions)
            except Exception:
                _log.exception("on_versions callback failed")


def _is_request(msg: Msg) -> bool:
    return not isinstance(msg, Hello | Heartbeat)


def _age(p: _Pending, now: float) -> float:
    return max(0.0, now - p.deadline)


def _fail(fut: concurrent.futures.Future[Msg], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

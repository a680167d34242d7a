"""The transport thread of a MemberClient: pending requests, outbox, heartbeats and the join handshake."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from astraflow import log
from astraflow.errors import ConnectError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import (
    BatchRequest,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Msg,
    TaskGrant,
    TaskRequest,
    Welcome,
)

if TYPE_CHECKING:
    from astraflow.transport.client import MemberClient

_log = log.get("transport.client")

REOPEN_AFTER_S = 6.0
"""Seconds of silence since the first message the controller has not answered after which the member
dials on a new connection (or REOPEN_BEATS beat intervals, if longer); doubles on each reopen without
an answer between. A live controller answers an idle member's heartbeats at least every 2 s
(roles/controller/beats.ACK_EVERY_S), or every other beat when it beats less often."""
REOPEN_BEATS = 4
"""Intervals (the one its last heartbeat announced) of silence before a member dials again."""
REOPEN_MAX_S = 60.0
"""The longest wait between two reopens (unless REOPEN_BEATS intervals are longer)."""


@dataclass
class Pending:
    """A request sent (or waiting to be sent) and the future its reply resolves."""

    msg: Msg
    future: concurrent.futures.Future[Msg]
    deadline: float
    timeout_s: float
    sent_on: int = 0
    """The connection (MemberLoop.connection) it was last sent on; 0: not sent yet."""


class MemberLoop:
    """State of the transport thread: pending requests, the outbox and the join handshake."""

    def __init__(self, client: MemberClient, sock: zmq.Socket, reopen: Callable[[], zmq.Socket]) -> None:
        self.c = client
        self.sock = sock
        self.reopen = reopen
        """Makes a fresh connected socket (see _reopen)."""
        self.opened = time.monotonic()
        self.connection = 1
        """Counts the sockets opened (see _reopen): a reply owed on an older one never comes."""
        self.reopen_after = REOPEN_AFTER_S
        """Silence before the next reopen; doubles each time (a slow controller is not a lost route)."""
        self.poller = zmq.Poller()
        self.pending: dict[int, Pending] = {}
        self.outbox: deque[Msg] = deque()
        self.backlog: deque[Pending] = deque()
        """Requests held while not joined (before Welcome, or after unknown_member)."""
        self.joined = False
        self.hello_rid = 0
        self.hello_sent = 0.0
        self.next_beat = 0.0
        self.last_beat = 0.0
        self.gap = client.heartbeat_interval_s
        """The interval the last heartbeat announced (its next_beat_s)."""
        self.error_sent = ""
        """The error the last heartbeat carried."""
        self.unanswered_since: float | None = None
        """When the first message sent since the controller was last heard from went out."""
        self.hung_logged = False

    def run(self) -> None:
        """Serve the socket until the client closes, then fail whatever is still pending."""
        c = self.c
        poller = self.poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(c.wake_fd, zmq.POLLIN)
        try:
            while not c.stopping:
                now = time.monotonic()
                wait = max(0.0, min(self.next_beat - now, 0.02 if self.outbox else 1.0))
                # Poller.poll takes a float timeout too (it truncates to int ms)
                for target, _ in poller.poll(wait * 1000):  # type: ignore[arg-type]
                    if target == c.wake_fd:
                        os.read(c.wake_fd, 4096)
                    else:
                        self._drain_socket()
                self._take_requests()
                self._heartbeat_or_hello()
                self._flush()
                self._expire()
        finally:
            # closed, or the thread failed: no request may wait for a reply that can no longer come
            why = "member client closed" if c.stopping else "member transport thread failed"
            self.fail_all(why)

    def fail_all(self, why: str) -> None:
        """Fail every pending, queued and joining request with ConnectError(why)."""
        c = self.c
        for p in list(self.pending.values()) + list(self.backlog):
            _fail(p.future, ConnectError(f"{why} before the reply came", hint=""))
        hello_future = c.take_hello_future()
        if hello_future is not None:
            _fail(hello_future, ConnectError(why, hint=""))
        while (item := c.take_request()) is not None:
            _fail(item.future, ConnectError(why, hint=""))

    # ----- outgoing ---------------------------------------------------------------------------

    def _take_requests(self) -> None:
        c = self.c
        hello_future = c.take_hello_future()
        if hello_future is not None:
            hello = c.hello
            self.pending.pop(self.hello_rid, None)  # a previous connect() that gave up
            hello.rid = self.hello_rid = c.next_rid()
            self.pending[hello.rid] = Pending(hello, hello_future, float("inf"), 0.0)
            self._send_hello()
        while (item := c.take_request()) is not None:
            if self.joined:
                self.pending[item.msg.rid] = item
                self.outbox.append(item.msg)
            else:
                self.backlog.append(item)

    def _send_hello(self) -> None:
        hello = self.c.hello
        if not self.hello_rid:
            hello.rid = self.hello_rid = self.c.next_rid()
        self.hello_sent = time.monotonic()
        # a re-sent Hello must be the only Hello in the outbox
        self.outbox = deque(m for m in self.outbox if not isinstance(m, Hello))
        self.outbox.appendleft(hello)

    def interval(self) -> float:
        """Seconds to the next heartbeat: the recipe's while the member holds leases, has a new error or
        waits on a request that is not a long poll; else the idle interval told (beat_pace.py). A
        long poll never received is still found: beats name it (`waiting`), an answer says lost."""
        c = self.c
        _, _, _, active, error = c.heartbeat_fields()
        if active or error != self.error_sent or c.idle_interval_s <= c.heartbeat_interval_s:
            return c.heartbeat_interval_s
        for p in self.pending.values():
            if not (isinstance(p.msg, TaskRequest | BatchRequest) and p.msg.wait_s > 0):
                return c.heartbeat_interval_s
        return c.idle_interval_s

    def _heartbeat_or_hello(self) -> None:
        c = self.c
        now = time.monotonic()
        if self.joined and not c.hung:
            # work arrived (a lease, an error, a request): the next beat comes at the recipe's interval
            self.next_beat = min(self.next_beat, self.last_beat + self.interval())
        if now < self.next_beat or c.leaving:
            return
        self.next_beat = now + c.heartbeat_interval_s
        # expecting an answer (a request in flight, or heartbeats going out) and hearing nothing: the
        # connection may be one the controller's ROUTER ignores (see _reopen); dial again. Silence is
        # counted from the first message not answered, and in the member's own beat intervals too
        expecting = bool(self.pending) or (self.joined and not c.hung)
        since = self.unanswered_since
        patience = max(self.reopen_after, REOPEN_BEATS * self.gap)
        if expecting and since is not None and now - max(self.opened, since) > patience:
            self._reopen()
            self.reopen_after = min(2 * self.reopen_after, REOPEN_MAX_S)
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
        loaded, busy, free, active, error = c.heartbeat_fields()
        # the requests already sent on this connection: the controller says which it never got
        waiting = [rid for rid, p in self.pending.items() if p.sent_on == self.connection][:256]
        gap = self.interval()
        self.last_beat, self.next_beat, self.gap, self.error_sent = now, now + gap, gap, error
        c.beats_sent += 1
        beat = Heartbeat(
            rid=c.next_rid(),
            loaded=loaded,
            busy=busy,
            free=free,
            active=active,
            error=error,
            waiting=waiting,
            relay_addr=c.relay_addr,
            next_beat_s=gap if gap > c.heartbeat_interval_s else 0.0,
        )
        # a heartbeat that cannot go out now is worthless later: replace any queued one
        self.outbox = deque(m for m in self.outbox if not isinstance(m, Heartbeat))
        self.outbox.append(beat)

    def _reopen(self) -> None:
        """Dial again on a fresh connection. The controller's ROUTER ignores a connection that claims
        a routing id still held by an older one (no handover; e.g. a reconnect that it sees before the
        old connection's close), and such a connection stays ignored even after the old one is gone;
        a new connection is accepted once the old one has closed. Replies owed on the old connection
        are lost: those requests time out and their callers retry."""
        _log.info(
            "no answer from %s for %.0fs: opening a new connection", self.c.controller, self.reopen_after
        )
        self.poller.unregister(self.sock)
        self.sock.close(0)
        self.sock = self.reopen()
        self.poller.register(self.sock, zmq.POLLIN)
        self.opened = time.monotonic()
        self.connection += 1

    def _flush(self) -> None:
        if self.outbox and self.unanswered_since is None:
            self.unanswered_since = time.monotonic()
        while self.outbox:
            msg = self.outbox[0]
            try:
                self.sock.send(encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                return  # no live connection yet: retry on the next loop turn
            self.outbox.popleft()
            p = self.pending.get(msg.rid)
            if p is not None and p.msg is msg and not isinstance(msg, Hello):
                p.sent_on = self.connection

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [rid for rid, p in self.pending.items() if p.deadline <= now]
        for rid in expired:
            p = self.pending.pop(rid)
            _fail(p.future, self.c.timeout_error(p.msg, p.timeout_s))
        if expired:
            live = {id(p.msg) for p in self.pending.values()}
            self.outbox = deque(m for m in self.outbox if not _is_request(m) or id(m) in live)
        kept: deque[Pending] = deque()
        for p in self.backlog:
            if p.deadline <= now:
                _fail(p.future, self.c.timeout_error(p.msg, p.timeout_s))
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
            self.unanswered_since = None
            self.reopen_after = REOPEN_AFTER_S
            self._handle(msg)

    def _handle(self, msg: Msg) -> None:
        c = self.c
        p: Pending | None
        if isinstance(msg, Error) and msg.code == "unknown_member":
            self._rejoin(msg.rid)
            return
        if isinstance(msg, Welcome):
            c.welcome = msg
            if msg.heartbeat_interval_s > 0:
                c.heartbeat_interval_s = msg.heartbeat_interval_s
            c.idle_interval_s = max(msg.idle_interval_s, c.heartbeat_interval_s)
            c.merge_versions(msg.versions)
            if msg.rid == self.hello_rid:
                self.joined = True
                self.hello_rid = 0
                self.last_beat, self.gap = time.monotonic(), c.heartbeat_interval_s
                self.next_beat = self.last_beat + c.heartbeat_interval_s
                for p in self.backlog:
                    self.pending[p.msg.rid] = p
                    self.outbox.append(p.msg)
                self.backlog.clear()
        elif isinstance(msg, HeartbeatAck):
            if msg.idle_interval_s > 0:
                c.idle_interval_s = max(msg.idle_interval_s, c.heartbeat_interval_s)
            c.merge_versions(msg.versions)
            c.stop_requested = c.stop_requested or msg.stop
            self._lost(msg.lost)
            return
        elif isinstance(msg, TaskGrant):
            c.merge_versions(msg.versions)
            c.stop_requested = c.stop_requested or msg.stop
        p = self.pending.pop(msg.rid, None)
        if p is not None and not p.future.done():
            p.future.set_result(msg)
        elif p is None and not isinstance(msg, Welcome):
            _log.debug("late or unsolicited %s rid=%d", type(msg).__name__, msg.rid)

    def _lost(self, rids: list[int]) -> None:
        """Requests the controller says it never got (it restarted, or a connection dropped them): their
        answers will not come, so their callers hear it now (ConnectError: they ask again) instead of at
        their deadlines, which a held long poll would otherwise wait out."""
        for rid in rids:
            p = self.pending.get(rid)
            if p is None or isinstance(p.msg, Hello) or p.sent_on == 0:
                continue
            del self.pending[rid]
            _fail(
                p.future,
                ConnectError(
                    f"controller at {self.c.controller} never got {type(p.msg).__name__} "
                    "(it restarted, or the connection dropped it)",
                    hint="ask again",
                ),
            )

    def _rejoin(self, rid: int) -> None:
        """The controller forgot us (it restarted): Hello again and replay the rejected request. Not once
        the member is leaving (close() began): the request fails instead."""
        p = self.pending.pop(rid, None)
        if self.c.leaving:
            if p is not None:
                _fail(
                    p.future, ConnectError(f"controller at {self.c.controller} no longer knows this member")
                )
            return
        if p is not None and isinstance(p.msg, Hello):
            self.pending[rid] = p
            p = None
        if p is not None:
            self.backlog.appendleft(p)
        if self.joined:
            _log.info("controller at %s does not know us: joining again", self.c.controller)
            self.joined = False
            # Requests in flight went to the old controller (their answers died with it, and a held
            # long poll would wait out its whole deadline) or to this one (refused as unknown_member).
            # Fail them all now: their callers take ConnectError as the signal to ask again, and
            # asking again goes out after the Welcome.
            for rid, pending in list(self.pending.items()):
                if not isinstance(pending.msg, Hello):
                    del self.pending[rid]
                    _fail(
                        pending.future,
                        ConnectError(
                            f"controller at {self.c.controller} no longer knew this member (it restarted, or "
                            f"declared it dead) before it answered {type(pending.msg).__name__}",
                            hint="ask again once joined",
                        ),
                    )
            live = {id(p.msg) for p in self.pending.values()}
            self.outbox = deque(m for m in self.outbox if not _is_request(m) or id(m) in live)
        if not self.hello_rid or time.monotonic() - self.hello_sent > self.c.heartbeat_interval_s:
            self._send_hello()


def _is_request(msg: Msg) -> bool:
    return not isinstance(msg, Hello | Heartbeat)


def _fail(fut: concurrent.futures.Future[Msg], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

"""A member's end of the control plane: one DEALER owned by a background thread, with heartbeats.

`MemberClient` is what a role holds: requests, the load and progress its heartbeats carry, the hang
watchdog; its socket thread is transport/member_loop.py. One-shot requests (no Hello, no heartbeats)
are transport/control_client.py.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from astraflow import log
from astraflow.errors import ConnectError, ProtocolError, Stopped
from astraflow.protocol.messages import (
    Bye,
    Error,
    Hello,
    Msg,
    VersionInfo,
    Welcome,
)
from astraflow.transport.member_loop import MemberLoop, Pending
from astraflow.transport.security import MemberCredentials, curve_client, member_credentials, routing_id
from astraflow.transport.server import DEFAULT_MAX_MESSAGE_BYTES, member_keepalive

_log = log.get("transport.client")

PROBE_AFTER_S = 2.0
"""Seconds without a Welcome after which connect() probes why (transport/probe.py)."""

STOP_POLL_S = 0.2
"""How often a request given a stop predicate checks it while it waits for its reply."""

GIVE_UP_ABSENT_S = 600.0
"""A joined member whose controller address has had nothing listening this long exits (check_reachable)."""

_HINT = "is `astraflow controller` running? check the address/port"
_HINT_KEY = (
    "is `astraflow controller` running there, is --controller-key its public key, and is this "
    "member's key added on the controller (`astraflow keys list`) and not revoked?"
)


class MemberClient:
    """Connects a member (RaaS, trainer, observer) to the controller and keeps it alive.

    All socket work happens on one background thread; submit() may be called from any thread.
    Heartbeats stop when the owner stops calling tick() for hang_timeout_s, so a hung process
    looks dead to the controller and its leases expire.
    """

    exit_on_failure: bool = True
    """A failed transport thread ends the process with exit 1 (its member can no longer talk)."""

    def __init__(
        self,
        controller: str,
        hello: Hello,
        *,
        heartbeat_interval_s: float = 0.5,
        hang_timeout_s: float = 30.0,
        connect_timeout_s: float = 20.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: MemberCredentials | None = None,
    ) -> None:
        """Prepare the client; nothing is sent until connect().

        credentials None takes the process's member credentials (security.set_member_credentials);
        with none at all the connection is plain (the controller must run without keys).
        """
        ident = hello.member_id.encode()
        # zmq routing ids are 1..255 bytes and a leading zero byte is reserved for generated ones
        if not 0 < len(ident) <= 255 or ident[0] == 0:
            raise ProtocolError(
                f"member id {hello.member_id!r} cannot be a socket identity",
                hint="use 1 to 255 bytes of text, e.g. raas-<host>-<n>",
            )
        from astraflow.transport.probe import parse_endpoint

        parse_endpoint(controller)  # a bad address is an error now, not a transport thread's crash
        self.controller = controller
        """The controller endpoint this client connects to."""
        self.hello = hello
        self.heartbeat_interval_s = heartbeat_interval_s
        """Seconds between heartbeats; replaced by the Welcome's value when that is positive."""
        self.idle_interval_s = heartbeat_interval_s
        """Seconds between heartbeats while idle (transport/member_loop.py `interval`): what the Welcome
        and the HeartbeatAcks tell, never less than heartbeat_interval_s."""
        self.hang_timeout_s = hang_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.versions: dict[str, VersionInfo] = {}
        """Newest version per policy seen in any reply; replaced whole, so reads need no lock."""
        self.stop_requested = False
        """True once the controller said stop (HeartbeatAck or TaskGrant)."""
        self.leaving = False
        """close() began: no Hello and no heartbeat goes out any more."""
        self.on_versions: Callable[[dict[str, VersionInfo]], None] | None = None
        """Called on the transport thread when `versions` changes; must return quickly."""
        self.welcome: Welcome | None = None
        """The latest Welcome received."""
        self.last_heard: float = 0.0
        """time.monotonic() of the last message from the controller (0 = never)."""
        self.beats_sent = 0
        """Heartbeats sent so far."""

        self._max_message_bytes = max_message_bytes
        self.credentials = credentials if credentials is not None else member_credentials()
        """Key pair and controller key this client authenticates with (None: plain)."""
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._load: tuple[dict[str, int], int, int] = ({}, 0, 0)
        self._progress: tuple[list[int], str] = ([], "")
        self.relay_addr = ""
        """The member's relay weight server, sent in every Heartbeat ("" = none)."""
        """Task ids in progress and the newest survived error, for the next Heartbeat."""
        self._last_tick = time.monotonic()
        self._inbox: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._hello_future: concurrent.futures.Future[Msg] | None = None
        self._absent_since: float | None = None
        """time.monotonic() since which probes found nothing listening at the controller's address."""

    # ----- owner API ------------------------------------------------------------------------

    def connect(self) -> Welcome:
        """Send Hello and wait for Welcome; ConnectError on timeout, ProtocolError if refused."""
        self.tick()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="astraflow-member", daemon=True)
            self._thread.start()
        fut: concurrent.futures.Future[Msg] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise ConnectError(
                    "member client is closed (its transport thread failed)", hint="see the log above"
                )
            self._hello_future = fut
        self._wake()
        try:
            reply = self._await_welcome(fut)
        except concurrent.futures.TimeoutError:
            raise ConnectError(
                f"controller at {self.controller} did not answer within {self.connect_timeout_s:g}s",
                hint=_HINT_KEY if self.credentials is not None else _HINT,
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

    def _await_welcome(self, fut: concurrent.futures.Future[Msg]) -> Msg:
        """The Hello's reply; when it is late, a probe names a cause waiting will not fix (bad address,
        nothing listening, a refused key) and that is raised at once instead of the timeout."""
        first = min(PROBE_AFTER_S, self.connect_timeout_s)
        try:
            return fut.result(first)
        except concurrent.futures.TimeoutError:
            if first >= self.connect_timeout_s:
                raise
        self.check_reachable(absent_is_fatal=True)
        return fut.result(max(0.0, self.connect_timeout_s - first))

    def check_reachable(self, *, absent_is_fatal: bool = False) -> None:
        """Probe the controller (transport/probe.py); raise what the probe found if waiting cannot fix it.

        A refused key, a wrong controller key or a bad address always raise; nothing listening at the
        address (or a silent host) raises with absent_is_fatal, else once it has lasted GIVE_UP_ABSENT_S
        (a controller may be restarting; a run that ended has none)."""
        from astraflow.transport.probe import ControllerAbsent, probe

        err = probe(self.controller, self.credentials)
        if not isinstance(err, ControllerAbsent):
            self._absent_since = None
        if err is None:
            return
        if isinstance(err, ControllerAbsent) and not absent_is_fatal:
            now = time.monotonic()
            self._absent_since = self._absent_since or now
            if now - self._absent_since < GIVE_UP_ABSENT_S:
                _log.warning("%s", err.message)
                return
            err.message += (
                f" for {GIVE_UP_ABSENT_S:.0f}s: giving up (the run has ended, or its controller is gone)"
            )
        raise err

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
        self._inbox.put(Pending(msg, fut, time.monotonic() + timeout_s, timeout_s))
        self._wake()
        return fut

    def request(self, msg: Msg, timeout_s: float = 30.0, stop: Callable[[], bool] | None = None) -> Msg:
        """Send a request and wait for its reply; ConnectError on timeout. With `stop`, the wait checks it
        every STOP_POLL_S and raises errors.Stopped once it is true (the reply, if any, is dropped)."""
        fut = self.submit(msg, timeout_s)
        deadline = time.monotonic() + timeout_s + 1.0
        while True:
            left = deadline - time.monotonic()
            try:
                return fut.result(max(0.0, left) if stop is None else min(max(0.0, left), STOP_POLL_S))
            except concurrent.futures.TimeoutError:
                if stop is not None and stop():
                    raise Stopped(f"stopped while waiting for the reply to {type(msg).__name__}") from None
                if time.monotonic() >= deadline:
                    raise self._timeout_error(msg, timeout_s) from None

    def set_load(self, loaded: dict[str, int], busy: int, free: int) -> None:
        """Set the load reported in the next Heartbeat."""
        with self._lock:
            self._load = (dict(loaded), busy, free)

    def set_progress(self, active: list[int], error: str = "") -> None:
        """Set the tasks the next Heartbeat reports progress on (only their leases are renewed) and an
        error to report; the first tasks, or a new error, wake the transport thread so a member that
        beat at its idle interval beats now."""
        with self._lock:
            old_active, old_error = self._progress
            self._progress = (list(active), error)
        if (active and not old_active) or error != old_error:
            self._wake()

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
        # from here the member never joins again: a controller that answers the Bye, or anything sent
        # before it, with unknown_member has forgotten it on purpose (a Hello now would leave a ghost)
        self.leaving = True
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

    # ----- what the transport thread (transport/member_loop.py) takes from its owner ----------

    @property
    def wake_fd(self) -> int:
        """The read end of the pipe the owner writes to wake the transport thread."""
        return self._wake_r

    @property
    def stopping(self) -> bool:
        """close() was called: the transport thread ends."""
        return self._stopping.is_set()

    def take_hello_future(self) -> concurrent.futures.Future[Msg] | None:
        """The future of a connect() waiting for its Welcome, handed over once (None: none waits)."""
        with self._lock:
            fut, self._hello_future = self._hello_future, None
        return fut

    def take_request(self) -> Pending | None:
        """The next request submit() queued (None: none)."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def next_rid(self) -> int:
        """A fresh request id (for a Hello or a Heartbeat the transport thread sends)."""
        return next(self._rids)

    def heartbeat_fields(self) -> tuple[dict[str, int], int, int, list[int], str]:
        """(loaded versions, busy, free, active task ids, error) for the next Heartbeat."""
        loaded, busy, free = self._load
        active, error = self._progress
        return loaded, busy, free, active, error

    def merge_versions(self, infos: list[VersionInfo]) -> None:
        """Take the versions a reply told (on the transport thread); calls on_versions when they changed."""
        current = self.versions
        # A newer version wins; the same version re-announced at another address (its trainer restarted
        # and serves it again) replaces the old address, or pulls would go on asking a dead server.
        newer = {
            v.policy: v
            for v in infos
            if v.policy not in current
            or v.version > current[v.policy].version
            or (v.version == current[v.policy].version and v.weights_addr != current[v.policy].weights_addr)
            or (v.version == current[v.policy].version and v.relays != current[v.policy].relays)
        }
        if not newer:
            return
        self.versions = {**current, **newer}
        if self.on_versions is not None:
            try:
                self.on_versions(self.versions)
            except Exception:
                _log.exception("on_versions callback failed")

    def timeout_error(self, msg: Msg, timeout_s: float) -> ConnectError:
        """The error a request gets when no reply came within timeout_s."""
        return self._timeout_error(msg, timeout_s)

    # ----- transport thread -----------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is already full of wakeups, or closing

    def _timeout_error(self, msg: Msg, timeout_s: float) -> ConnectError:
        return ConnectError(
            f"controller at {self.controller} did not answer {type(msg).__name__} within {timeout_s:g}s",
            hint=_HINT,
        )

    def _open_socket(self, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        """A new DEALER connected to the controller (CURVE when the client has credentials)."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(self.hello.member_id, self.credentials))
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        # queue only to a live connection: nothing stale piles up while the controller is away
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # a connection to a vanished controller host is noticed by the kernel and redialled (sooner,
        # while an answer is awaited, by the member loop's reopen)
        member_keepalive(sock)
        if self.credentials is not None:
            curve_client(sock, self.credentials.keypair, self.credentials.controller_public)
        sock.connect(self.controller)
        return sock

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        loop = MemberLoop(self, self._open_socket(ctx), lambda: self._open_socket(ctx))
        try:
            loop.run()
        except Exception:  # a crashed transport thread would otherwise look like a silent hang
            with self._lock:
                self._closed = True  # new requests fail at once
            loop.fail_all("member transport thread failed")  # also those queued while it died
            _log.exception("member transport thread failed; this member cannot reach the controller")
            if self.exit_on_failure:
                logging.shutdown()
                os._exit(1)  # a supervisor (`astraflow up`) restarts a member that exits 1
        finally:
            loop.sock.close(0)
            ctx.term()

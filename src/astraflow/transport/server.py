"""The controller's end of the control plane: one ROUTER socket, polled by a single-threaded loop."""

from __future__ import annotations

from typing import Any

import zmq

from astraflow import log
from astraflow.errors import ConnectError
from astraflow.protocol.codec import DecodeError, decode, encode, peek_rid
from astraflow.protocol.messages import Error, Hello, Msg
from astraflow.transport.keys import KeyStore
from astraflow.transport.principal import Principal
from astraflow.transport.security import curve_server, server_keys

_log = log.get("transport.server")

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""Largest frame a peer may send before it is disconnected (zmq MAXMSGSIZE)."""

_MAX_DRAIN = 4096
"""Messages taken per poll() so one chatty peer cannot starve the caller's loop forever."""

HEARTBEAT_IVL_MS = 1000
"""ZMTP heartbeat interval of the weight plane: a connection whose peer stopped answering is dropped
after the timeout."""
HEARTBEAT_TIMEOUT_MS = 5000
"""ZMTP heartbeat timeout of the weight plane."""
MEMBER_KEEPALIVE_IDLE_S = 10
"""TCP keepalive of a member's control connection: after this many seconds without a segment from the
controller's host, the member's kernel probes it (MEMBER_KEEPALIVE_CNT probes,
MEMBER_KEEPALIVE_INTVL_S apart) and drops the connection once MEMBER_TIMEOUT_MS passed unanswered
(also while data waits unacknowledged: TCP_USER_TIMEOUT), so a connection to a vanished host is
noticed and redialled. Kernels send and answer the probes; neither process wakes for them. Members
used to send ZMTP pings every 10 s instead: libzmq's I/O thread in the controller answered each,
1,000 wake-ups a second at 10,000 members on the controller's core (docs/benchmarks.md, "Members'
pings moved to the kernel")."""
MEMBER_KEEPALIVE_INTVL_S = 5
MEMBER_KEEPALIVE_CNT = 4
MEMBER_TIMEOUT_MS = 30_000
KEEPALIVE_IDLE_S = 30
"""TCP keepalive of the controller's connections: a connection whose host vanished (no FIN, no RST)
is dropped after KEEPALIVE_IDLE_S + KEEPALIVE_CNT * KEEPALIVE_INTVL_S s of silence, which frees its
routing id; the kernel does it, at no cost to the controller's threads."""
KEEPALIVE_INTVL_S = 10
KEEPALIVE_CNT = 3


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (each connection is a file descriptor:
    a controller of 10,000 members needs more than the usual 1,024); returns the limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY not in (soft, hard) and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # the limit stays; the error comes when a connection cannot be accepted
    return soft


def member_keepalive(sock: zmq.Socket[Any]) -> None:
    """Set a member's control socket, before it connects, to have its kernel notice a vanished
    controller host: TCP keepalive after MEMBER_KEEPALIVE_IDLE_S of silence and TCP_USER_TIMEOUT
    (zmq's TCP_MAXRT) of MEMBER_TIMEOUT_MS."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, MEMBER_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, MEMBER_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, MEMBER_KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, MEMBER_TIMEOUT_MS)


Polled = tuple[bytes, Principal | None, Msg | DecodeError]
"""One received frame: routing identity, authenticated sender (None when auth is off), message."""


class RouterServer:
    """A bound ROUTER socket that yields (identity, principal, message) and never raises on bad input.

    Framing is exactly two frames as seen by the ROUTER: [identity, msgpack payload]. Members use
    DEALER sockets whose routing id is their member id, so no empty delimiter frame is used.

    With a key store the socket is a CURVE server: only registered, non-revoked keys connect, each
    frame's sender is looked up in the store as it is now (a revoked key's frames are dropped at
    once, even on a connection opened before), and the identity poll() yields is the key's member
    name, never the routing id the peer chose: members dial with a random routing id
    (security.routing_id), so no other key can hold or pre-empt the connection a member's replies
    take, and a revoked key's connection, though libzmq keeps it open, routes nothing.
    Without keys the routing id is the member id. ROUTER_HANDOVER is off: a second connection that
    claims a live routing id is ignored by the ROUTER until the first one is gone: a process that
    exits has its connection closed by its kernel at once, one whose host vanished is dropped by TCP
    keepalive (KEEPALIVE_IDLE_S).
    """

    def __init__(
        self, bind: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keys: KeyStore | None = None
    ) -> None:
        """Bind a ROUTER on `bind`; "tcp://127.0.0.1:0" picks a free port (see `address`).

        keys None takes the process's key store set by the CLI (security.set_server_keys), if any.
        """
        keys = keys if keys is not None else server_keys()
        raise_fd_limit()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self._sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self._sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        self._sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
        self._sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
        # replies to peers that are gone (or over their HWM) are dropped instead of blocking
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.keys = keys
        """The key store that authenticates members; None: authentication off."""
        self._auth = None
        if keys is not None:
            self._auth = curve_server(self._ctx, self._sock, keys.controller_keypair(), keys.admits)
        try:
            if bind.endswith(":0"):
                port = self._sock.bind_to_random_port(bind[: -len(":0")])
                self.address: str = f"{bind[: -len(':0')]}:{port}"
                """The concrete endpoint after bind (port 0 resolved)."""
            else:
                self._sock.bind(bind)
                self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._teardown()
            raise ConnectError(
                f"cannot bind {bind}: {exc}",
                hint="is another process using this port? pick another with --bind",
            ) from None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._closed = False
        self.refused = 0
        """Frames refused by the transport itself (unknown or revoked key, wrong identity or role)."""
        self.drained = True
        """Whether the last poll read everything that was readable (False: it stopped at _MAX_DRAIN)."""
        self._routes: dict[bytes, bytes] = {}
        """Member name -> routing id of the connection its key last spoke on (one entry per key)."""

    def poll(self, timeout_ms: int) -> list[Polled]:
        """Wait up to timeout_ms for input, then drain what is readable without blocking.

        Each message is taken frame by frame (a message's frames arrive together), not with
        recv_multipart (cheaper per message): thousands of members' heartbeats make
        this the controller's hottest loop."""
        out: list[Polled] = []
        self.drained = True
        if self._closed:
            return out
        if self.keys is not None:
            self.keys.refresh()
        # what is readable already is read without a zmq_poll first: with thousands of connections
        # that call costs more than the messages it announces
        self._drain(out)
        if not out and self._poller.poll(timeout_ms):
            self._drain(out)
        return out

    def _drain(self, out: list[Polled]) -> None:
        """Read what is readable now into `out`, up to _MAX_DRAIN messages."""
        keys = self.keys
        recv = self._sock.recv
        while True:
            if len(out) >= _MAX_DRAIN:
                self.drained = False  # more may wait: the caller's loop gets its turn first
                break
            try:
                route: bytes = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                frame: zmq.Frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # a ROUTER never yields a routing id alone; never trust that here
                out.append((route, None, DecodeError("expected 2 frames, got 1")))
                continue
            frames = 2
            last = frame
            while last.more:
                last = recv(zmq.NOBLOCK, copy=False)
                frames += 1
            identity, principal = route, None
            if keys is not None:
                principal = self._principal(last)
                if principal is None:
                    self.refused += 1  # a key revoked while its connection was open: deliver nothing
                    continue
                # the key, not the routing id the peer chose, names the sender; replies go back on
                # the connection this key spoke on last
                identity = principal.name.encode()
                self._routes[identity] = route
            if frames != 2:
                out.append((identity, principal, DecodeError(f"expected 2 frames, got {frames}")))
                continue
            try:
                msg: Msg | DecodeError = decode(frame.bytes)
            except DecodeError as exc:
                msg = exc
            if principal is not None and isinstance(msg, Hello):
                why = _hello_mismatch(msg, principal)
                if why:
                    self._refuse(route, frame.bytes, "bad_identity", why)
                    continue
            out.append((identity, principal, msg))

    def _principal(self, frame: zmq.Frame) -> Principal | None:
        assert self.keys is not None
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        key = user.encode() if isinstance(user, str) else b""
        found = self.keys.principal(key)
        if found is None and key:
            # admitted at the handshake a moment ago: look at the registry again
            self.keys.refresh(every_s=0.0)
            found = self.keys.principal(key)
        return found

    def _refuse(self, route: bytes, payload: bytes, code: str, why: str) -> None:
        """Answer the connection a refused frame came on (its routing id, never a member's route)."""
        self.refused += 1
        self._send_to(route, Error(rid=peek_rid(payload), code=code, message=why))

    def send(self, identity: bytes, msg: Msg) -> None:
        """Send to one peer; dropped silently if the peer is unknown or not reading.

        With keys `identity` is a member name: the reply goes on the connection its key spoke on last
        (nothing is sent to a name whose key never spoke)."""
        route = identity if self.keys is None else self._routes.get(identity)
        if route is None:
            _log.debug("dropped %s to %r: its key has no connection", type(msg).__name__, identity)
            return
        self._send_to(route, msg)

    def _send_to(self, route: bytes, msg: Msg) -> None:
        if self._closed:
            return
        try:
            self._sock.send_multipart([route, encode(msg)], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            _log.debug("dropped %s to %r: peer not reading", type(msg).__name__, route)
        except zmq.ZMQError as exc:
            _log.warning("dropped %s to %r: %s", type(msg).__name__, route, exc)

    def close(self) -> None:
        """Close the socket at once (LINGER 0) and release the port."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _hello_mismatch(hello: Hello, who: Principal) -> str:
    """Why a Hello does not fit the key that sent it ('' when it does)."""
    if hello.member_id != who.name:
        return f"member_id {hello.member_id!r} is not this key's member {who.name!r}"
    if hello.role != who.role:
        return f"this key is for role {who.role!r}, not {hello.role!r}"
    if who.policy is not None and any(p != who.policy for p in hello.policies):
        return f"this key acts only for policy {who.policy!r}"
    return ""

"""The controller's end of the control plane: one ROUTER socket, polled by a single-threaded loop."""

from __future__ import annotations

import zmq

from astraflow import log
from astraflow.errors import ConnectError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import Error, Msg

_log = log.get("transport.server")

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""Largest frame a peer may send before it is disconnected (zmq MAXMSGSIZE)."""

_MAX_DRAIN = 4096
"""Messages taken per poll() so one chatty peer cannot starve the caller's loop forever."""


class RouterServer:
    """A bound ROUTER socket that yields (identity, message) pairs and never raises on bad input.

    Framing is exactly two frames as seen by the ROUTER: [identity, msgpack payload]. Members use
    DEALER sockets whose routing id is their member id, so no empty delimiter frame is used.
    """

    def __init__(self, bind: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        """Bind a ROUTER on `bind`; "tcp://127.0.0.1:0" picks a free port (see `address`)."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # a restarted member reconnecting with the same id replaces the stale connection
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # replies to peers that are gone (or over their HWM) are dropped instead of blocking
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if bind.endswith(":0"):
                port = self._sock.bind_to_random_port(bind[: -len(":0")])
                self.address: str = f"{bind[: -len(':0')]}:{port}"
                """The concrete endpoint after bind (port 0 resolved)."""
            else:
                self._sock.bind(bind)
                self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise ConnectError(
                f"cannot bind {bind}: {exc}",
                hint="is another process using this port? pick another with --bind",
            ) from None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._closed = False

    def poll(self, timeout_ms: int) -> list[tuple[bytes, Msg | DecodeError]]:
        """Wait up to timeout_ms for input, then drain what is readable without blocking."""
        out: list[tuple[bytes, Msg | DecodeError]] = []
        if self._closed or not self._poller.poll(timeout_ms):
            return out
        while len(out) < _MAX_DRAIN:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            identity = frames[0]
            if len(frames) != 2:
                out.append((identity, DecodeError(f"expected 2 frames, got {len(frames)}")))
                continue
            try:
                out.append((identity, decode(frames[1])))
            except DecodeError as exc:
                out.append((identity, exc))
        return out

    def send(self, identity: bytes, msg: Msg) -> None:
        """Send to one peer; dropped silently if the peer is unknown or not reading."""
        if self._closed:
            return
        try:
            self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            _log.debug("dropped %s to %r: peer not reading", type(msg).__name__, identity)
        except zmq.ZMQError as exc:
            _log.warning("dropped %s to %r: %s", type(msg).__name__, identity, exc)

    def reply_error(self, identity: bytes, err: DecodeError) -> None:
        """Answer a DecodeError from poll() with an Error message carrying its code and rid."""
        self.send(identity, Error(rid=err.rid, code=err.code, message=str(err)[:500]))

    def close(self) -> None:
        """Close the socket at once (LINGER 0) and release the port."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(0)
        self._ctx.term()

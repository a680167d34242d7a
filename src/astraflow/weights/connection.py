"""One connection of a weight pull: a DEALER to the weight server, the state of its link as its
socket monitor reports it, and the reads of one reply (a decoded first frame, a chunk's bytes
received in place)."""

from __future__ import annotations

import os

import zmq
from zmq.utils.monitor import recv_monitor_message

from astraflow.errors import ProtocolError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import Msg, WeightChunk, WeightRequest
from astraflow.transport.keys import KeyPair
from astraflow.transport.security import curve_client, member_credentials

_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_FAILED |= zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class PullConnection:
    """A DEALER connected to one weight server, with its own routing id (and CURVE session)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        server_key: bytes | None,
        addr: str,
        max_chunk_bytes: int,
    ) -> None:
        """Connect (asynchronously: `handshaken` turns true when the monitor says so)."""
        self.addr = addr
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_chunk_bytes + (64 << 10))
        self.sock.setsockopt(zmq.ROUTING_ID, b"w-" + os.urandom(8).hex().encode())
        if server_key is not None:
            creds = member_credentials()
            # without member credentials (a test, a tool) a throwaway key pair still encrypts and
            # checks the server; a server restricted to member keys then refuses it
            pair = creds.keypair if creds is not None else KeyPair(*zmq.curve_keypair())
            curve_client(self.sock, pair, server_key)
        self.monitor = self.sock.get_monitor_socket(_EVENTS | _FAILED)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ok = True
        """Believed to deliver: no drop, refusal or unanswered request since it last answered."""
        self.handshaken = False
        """Its link completed a handshake once (the server then placed it on one of its I/O threads)."""
        self.retired = False
        """It delivered a chunk that failed its sha256: it gets no more requests in this pull."""
        self.load = 0
        """Chunk requests it carries now."""

    def close(self) -> None:
        """Close the socket and its monitor (the context is the puller's)."""
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)

    def send(self, req: WeightRequest) -> None:
        """Queue a request; a link that cannot take it now (a refused CURVE handshake drops it) is
        left to the puller's resend timer."""
        try:
            self.sock.send(encode(req), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def events(self) -> bool:
        """Read the monitor's pending events; True when the link dropped (its replies in flight are lost)."""
        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.ok = self.handshaken = True
            elif event == zmq.EVENT_DISCONNECTED or event & _FAILED:
                self.ok = False
                dropped = True
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.ok = False
        return dropped

    def recv(self, wait_s: float) -> Msg | None:
        """The next reply's first frame, decoded; a WeightChunk's bytes are left for `data`."""
        if not self.sock.poll(max(0, int(wait_s * 1000))):
            return None
        head = self.sock.recv(copy=False)
        self.ok = True
        try:
            msg = decode(head.buffer)
        except DecodeError as exc:
            self.skip_rest()
            raise ProtocolError(
                f"weight server {self.addr} sent an undecodable reply: {exc}", hint=""
            ) from None
        if isinstance(msg, WeightChunk) != bool(head.more):
            self.skip_rest()
            raise ProtocolError(f"weight server {self.addr} sent a reply with the wrong frames", hint="")
        return msg

    def skip_rest(self) -> None:
        """Drop the remaining frames of the current reply."""
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(copy=False)

    def frame(self) -> zmq.Frame:
        """Receive a WeightChunk's bytes as libzmq holds them (no copy): the caller copies them where
        they belong, on another thread if it likes (the frame keeps the bytes alive until dropped)."""
        got = self.sock.recv(copy=False)
        if self.sock.getsockopt(zmq.RCVMORE):
            self.skip_rest()
            raise ProtocolError(f"weight server {self.addr} sent a chunk with extra frames", hint="")
        return got

    def data(self, dest: memoryview | None) -> int:
        """Receive a WeightChunk's bytes straight into `dest` (None: drop them); their length."""
        if dest is None:
            n = len(self.sock.recv(copy=False))
        else:
            n = self.sock.recv_into(dest)
        if self.sock.getsockopt(zmq.RCVMORE):
            self.skip_rest()
            raise ProtocolError(f"weight server {self.addr} sent a chunk with extra frames", hint="")
        return n

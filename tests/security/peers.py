"""A hostile peer for the attack tests: a raw DEALER socket speaking the codec, no client library."""

from __future__ import annotations

import zmq

from astraflow.protocol.codec import decode, encode
from astraflow.protocol.messages import PROTOCOL_VERSION, Hello, Msg


class Peer:
    """A DEALER with a chosen identity; ask() sends one message and waits for the rid-matched reply."""

    def __init__(self, ctx: zmq.Context, addr: str, ident: str) -> None:
        self.ident = ident
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, ident.encode())
        self.sock.connect(addr)
        self.rid = 0

    def ask(self, msg: Msg, timeout_ms: int = 20_000) -> Msg:
        self.rid += 1
        msg.rid = self.rid
        self.sock.send(encode(msg))
        while True:
            assert self.sock.poll(timeout_ms), f"no reply to {type(msg).__name__}"
            reply = decode(self.sock.recv())
            if reply.rid == msg.rid:
                return reply

    def tell(self, msg: Msg) -> None:
        """Send one message without waiting: a Heartbeat is not a request (an idle member's beats are
        answered only when it has something to learn, and at least every 2 s)."""
        self.rid += 1
        msg.rid = self.rid
        self.sock.send(encode(msg))

    def hello(self, role: str, policies: list[str] | None = None, **kw: object) -> Msg:
        return self.ask(
            Hello(
                member_id=self.ident,
                role=role,
                protocol=PROTOCOL_VERSION,
                policies=["main"] if policies is None else policies,
                pid=4242,
                host="attacker",
                **kw,  # type: ignore[arg-type]
            )
        )

    def close(self) -> None:
        self.sock.close(0)

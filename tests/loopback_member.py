"""A real MemberClient against a ROUTER on loopback that a test's own fake controller serves: the
socket, the server thread, the member's ticking thread and the teardown, shared by the tests that
play the controller by hand (a heartbeat pace, a forged batch)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import zmq

from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.transport.client import MemberClient


class Served(Protocol):
    """A fake controller: serves its ROUTER until `stop` is set."""

    stop: threading.Event

    def serve(self) -> None: ...


S = TypeVar("S", bound=Served)


def serve_router(sock: zmq.Socket, stop: threading.Event, answer: Callable[[m.Msg], m.Msg | None]) -> None:
    """A fake controller's loop: each message read from `sock` until `stop` is set, answered with
    `answer(msg)` on the connection it came from (nothing when that is None)."""
    while not stop.is_set():
        if not sock.poll(20):
            continue
        ident, frame = sock.recv_multipart()
        reply = answer(decode(frame))
        if reply is not None:
            sock.send_multipart([ident, encode(reply)])


@contextmanager
def member_of(
    make: Callable[[zmq.Socket], S], hello: m.Hello, heartbeat_interval_s: float
) -> Iterator[tuple[S, MemberClient, m.Welcome]]:
    """The fake controller `make(router)` serving on a loopback port, and a connected MemberClient
    ticked every 50 ms (with its Welcome); everything closed on exit."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ctl = make(router)
    thread = threading.Thread(target=ctl.serve, daemon=True)
    thread.start()
    client = MemberClient(
        f"tcp://127.0.0.1:{port}", hello, heartbeat_interval_s=heartbeat_interval_s, credentials=None
    )
    client.exit_on_failure = False
    ticking = threading.Event()

    def tick() -> None:
        while not ticking.is_set():
            client.tick()
            time.sleep(0.05)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield ctl, client, client.connect()
    finally:
        ticking.set()
        client.leaving = True
        client.close()
        ctl.stop.set()
        thread.join(2)
        router.close(0)
        ctx.term()

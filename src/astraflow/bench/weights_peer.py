"""The receiving side of `astraflow bench weights` (a RaaS's role), in its own process: one JSON
command a line on stdin, one JSON line answered on stdout when it is done (or an error)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


class _Receiver:
    """What a worker holds between commands: its parameters, pull buffers, transports and sockets."""

    def __init__(self, device: str) -> None:
        import torch

        from astraflow.weights.client import RecvBuffers
        from astraflow.weights.transport import BroadcastTransport, SharedTransport

        self.torch = torch
        self.buffers = RecvBuffers()  # reused between pulls, as a worker's pulls reuse theirs
        self.dev = torch.device(device)
        self.shared = SharedTransport(self.dev)
        self.bcast = BroadcastTransport(
            self.dev if self.dev.type != "cuda" else torch.device("cpu"),
            member_id="bench-peer",
            timeout_s=60.0,
            wait_s=120.0,
        )
        self.params: dict[str, Any] = {}
        self.offer: Any = None
        self.pulls: dict[str, Any] = {}

    def apply(self, tensors: dict[str, Any]) -> None:
        """Copy a version into the held parameters (allocated on first use), then wait for the copy."""
        for k, v in tensors.items():
            if k not in self.params:
                self.params[k] = self.torch.empty(v.shape, dtype=v.dtype, device=self.dev)
            self.params[k].copy_(v, non_blocking=True)
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def on_shared(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from astraflow.protocol.messages import VersionInfo, WeightOffer

        o = WeightOffer(
            kind=cmd["kind"],
            host=self.shared.host,
            path=cmd["path"],
            ipc=bytes.fromhex(cmd["ipc"]),
            digest=cmd["digest"],
        )
        got = self.shared.receive(VersionInfo(policy="bench", version=cmd["version"], weights_addr=""), o)
        self.apply(got.tensors)
        got.release()
        return {}

    def on_join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from astraflow.protocol.messages import WeightOffer

        self.offer = WeightOffer(kind="broadcast", address=cmd["address"], token=cmd["token"])
        self.bcast.member(self.offer)
        return {}

    def on_leave(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.bcast.close()
        return {}

    def on_bcast(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from astraflow.weights import packed

        assert self.offer is not None, "bcast before join"
        m = self.bcast.member(self.offer)
        p = m.wait_for(cmd["version"], 120.0)
        assert p is not None and m.layout is not None and packed.digest(p.buf) == p.digest
        self.apply(packed.views(p.buf, m.layout))
        return {}

    def on_raw(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Receive nbytes over one PULL socket per address (connected once, reused every round)."""
        import zmq

        socks = [self._pull_socket(address, cmd.get("server_key")) for address in cmd["addresses"]]
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        n = 0
        while n < cmd["nbytes"]:
            for sock, _ in poller.poll():
                while n < cmd["nbytes"]:
                    try:
                        n += len(sock.recv(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
        return {}

    def _pull_socket(self, address: str, server_key: str | None) -> Any:
        import zmq

        if address not in self.pulls:
            pull = self.pulls[address] = zmq.Context().socket(zmq.PULL)  # a context each
            if server_key:
                public, secret = zmq.curve_keypair()
                pull.setsockopt(zmq.CURVE_PUBLICKEY, public)
                pull.setsockopt(zmq.CURVE_SECRETKEY, secret)
                pull.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode())
            pull.connect(address)
        return self.pulls[address]

    def on_zmq(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from astraflow.weights.client import fetch_weights
        from astraflow.weights.snapshot import bytes_to_state_dict

        t0 = time.perf_counter()
        blob = fetch_weights(
            cmd["address"],
            "bench",
            cmd["version"],
            expect_sha256=cmd["sha256"],
            into=self.buffers,
            connections=cmd["connections"],
        )
        t1 = time.perf_counter()
        self.apply(bytes_to_state_dict(blob))
        self.buffers.give(blob)
        return {"pull_s": t1 - t0, "apply_s": time.perf_counter() - t1}


def serve(device: str) -> None:
    """Answer the bench's commands until stdin closes."""
    import torch

    torch.set_num_threads(1)
    receiver = _Receiver(device)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "tcp":  # says "done" once a round itself
                _tcp_rounds(cmd["ports"], cmd["nbytes"], cmd["rounds"])
                continue
            extra = getattr(receiver, f"on_{cmd['op']}")(cmd)
            print(json.dumps({"done": time.time(), **extra}), flush=True)
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


def _tcp_rounds(ports: list[int], nbytes: int, rounds: int) -> None:
    """The receiving side of `_tcp`: connect a socket a port, then each round receive the blob's
    share on each (a thread a socket, into a reused buffer) and say when all arrived."""
    import socket
    import threading

    socks = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    share = -(-nbytes // len(socks))
    sizes = [min(share, nbytes - i * share) for i in range(len(socks))]
    bufs = [bytearray(4 << 20) for _ in socks]

    def drain(sock: socket.socket, size: int, buf: bytearray) -> None:
        view = memoryview(buf)
        while size > 0:
            got = sock.recv_into(view[: min(size, len(view))])
            if not got:
                raise ConnectionError("the sender closed early")
            size -= got

    try:
        for _ in range(rounds):
            readers = [threading.Thread(target=drain, args=a) for a in zip(socks, sizes, bufs, strict=True)]
            for t in readers:
                t.start()
            for t in readers:
                t.join()
            print(json.dumps({"done": time.time()}), flush=True)
    finally:
        for sock in socks:
            sock.close()

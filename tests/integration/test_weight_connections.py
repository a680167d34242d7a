"""A weight pull over several connections, with faults on the path: a real weight server, real
ZeroMQ sockets (CURVE where said) and, between them, a TCP relay in this process that cuts one
connection mid-pull (and swallows every later one) or flips a byte of a chunk on one connection.
The pull must lose nothing: the cut connection's chunks arrive over the others, the corrupted chunk
is asked again on another connection, and only when every connection corrupts does the pull fail."""

from __future__ import annotations

import glob
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from astraflow.errors import WeightIntegrityError
from astraflow.transport.keys import KeyPair
from astraflow.weights import chunk_pull
from astraflow.weights import client as wclient
from astraflow.weights.client import fetch_weights
from astraflow.weights.server import WeightServer

CHUNK = 256 << 10
BLOB = 8 << 20  # 32 chunks; with one connection per MiB a pull opens all four


class PathFaults:
    """A TCP relay from pullers to one weight server. Connection `cut` (by accept order) is reset
    once it carried `cut_after` bytes to the puller and `wait_for` connections were accepted; every
    connection accepted after that is held open and never forwarded. Connections in `tamper` get
    the byte at `tamper_at` of their server-to-puller stream flipped."""

    def __init__(
        self,
        port: int,
        *,
        cut: int | None = None,
        cut_after: int = 0,
        wait_for: int = 1,
        tamper: set[int] | None = None,
        tamper_at: int = 0,
    ) -> None:
        self.upstream = ("127.0.0.1", port)
        self.cut, self.cut_after, self.wait_for = cut, cut_after, wait_for
        self.tamper, self.tamper_at = tamper or set(), tamper_at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.enough = threading.Event()
        self.cut_done = threading.Event()
        self.flipped: list[int] = []
        self.carried: dict[int, int] = {}
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            self.socks.append(down)
            index = self.accepted
            self.accepted += 1
            if self.accepted >= self.wait_for:
                self.enough.set()
            if self.cut_done.is_set():
                continue  # held, never forwarded: a link that connects and then says nothing
            up = socket.create_connection(self.upstream)
            self.socks.append(up)
            threading.Thread(target=self._pump, args=(down, up, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, index), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, index: int | None) -> None:
        """Forward src to dst; `index` names a server-to-puller direction, where the faults apply."""
        n = 0
        try:
            while data := src.recv(1 << 16):
                if index is not None:
                    if index in self.tamper and n <= self.tamper_at < n + len(data):
                        buf = bytearray(data)
                        buf[self.tamper_at - n] ^= 0xFF
                        data = bytes(buf)
                        self.flipped.append(index)
                    if index == self.cut and n + len(data) >= self.cut_after:
                        self.enough.wait(10)  # the other connections are open: the cut is mid-pull
                        self.carried[index] = n
                        self.cut_done.set()
                        dst.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                        )
                        for s in (dst, src):  # shutdown wakes the other direction's recv, so the
                            s.shutdown(socket.SHUT_RDWR)  # close below really ends the connection
                            s.close()
                        return
                    n += len(data)
                    self.carried[index] = n
                dst.sendall(data)
        except OSError:
            pass

    @property
    def address(self) -> str:
        """Where pullers dial."""
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Close every socket it holds."""
        self.listener.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture(autouse=True)
def one_connection_per_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_pull, "CONNECTION_BYTES", 1 << 20)


@pytest.fixture
def blob() -> bytes:
    return os.urandom(BLOB)


def _serve(blob: bytes, keypair: KeyPair | None) -> tuple[WeightServer, str, str]:
    server = WeightServer(chunk_bytes=CHUNK, keypair=keypair)
    m = server.publish("p", 1, blob)
    return server, server.address.partition("#")[0], m.sha256


@pytest.fixture
def curve_server(blob: bytes) -> Iterator[tuple[WeightServer, str, str]]:
    server, endpoint, sha = _serve(blob, KeyPair(*zmq.curve_keypair()))
    yield server, endpoint, sha
    server.close()


def test_a_connection_cut_mid_pull_loses_nothing(
    blob: bytes, curve_server: tuple[WeightServer, str, str]
) -> None:
    server, endpoint, sha = curve_server
    proxy = PathFaults(int(endpoint.rsplit(":", 1)[1]), cut=1, cut_after=CHUNK // 2, wait_for=4)
    try:
        key = server.address.partition("#")[2]
        got = fetch_weights(f"{proxy.address}#{key}", "p", 1, expect_sha256=sha, connections=4, timeout_s=60)
        assert got == blob
        # the second connection was cut after it carried part of a chunk, with four open: mid-pull
        assert proxy.cut_done.is_set() and 0 < proxy.carried[1] < BLOB and proxy.accepted >= 4
    finally:
        proxy.close()


def test_a_chunk_corrupted_on_one_connection_is_asked_again_on_another(
    blob: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    server, endpoint, sha = _serve(blob, None)  # no CURVE: a flipped byte reaches the puller
    proxy = PathFaults(int(endpoint.rsplit(":", 1)[1]), tamper={1}, tamper_at=CHUNK // 2)
    try:
        with caplog.at_level(logging.WARNING, logger="astraflow.weights.chunk_pull"):
            got = fetch_weights(proxy.address, "p", 1, expect_sha256=sha, connections=4, timeout_s=60)
        assert got == blob and proxy.flipped == [1]
        assert "failed its sha256 on one connection" in caplog.text
    finally:
        proxy.close()
        server.close()


def test_chunks_corrupted_on_every_connection_fail_the_pull(blob: bytes) -> None:
    server, endpoint, sha = _serve(blob, None)
    proxy = PathFaults(int(endpoint.rsplit(":", 1)[1]), tamper={0, 1, 2, 3}, tamper_at=CHUNK // 2)
    try:
        with pytest.raises(WeightIntegrityError, match="fails its sha256"):
            fetch_weights(proxy.address, "p", 1, expect_sha256=sha, connections=4, timeout_s=60)
        assert sorted(proxy.flipped) == [0, 1, 2, 3]
    finally:
        proxy.close()
        server.close()


def _io_threads() -> dict[str, int]:
    """CPU nanoseconds of each libzmq I/O thread of this process, by thread id."""
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as comm, open(f"{task}/schedstat") as stat:
                if comm.read().startswith("ZMQbg/IO"):
                    out[task] = int(stat.read().split()[0])
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads per-thread CPU time from /proc")
def test_a_curve_pull_over_four_connections_encrypts_on_four_io_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _io_threads()
    server = WeightServer(keypair=KeyPair(*zmq.curve_keypair()), chunk_bytes=1 << 20, io_threads=4)
    served: dict[str, int] = {}
    for _ in range(500):  # a new thread names itself once it runs
        served = {t: ns for t, ns in _io_threads().items() if t not in before}
        if len(served) >= 4:
            break
        time.sleep(0.01)
    seen: dict[str, int] = {}
    close = wclient._Puller.__exit__

    def read_then_close(self: wclient._Puller, *exc: object) -> None:
        seen.update(_io_threads())  # the puller's I/O threads end with its context
        close(self, *exc)

    monkeypatch.setattr(wclient._Puller, "__exit__", read_then_close)
    try:
        blob = os.urandom(64 << 20)
        sha = server.publish("p", 1, blob).sha256
        served = {t: ns for t, ns in _io_threads().items() if t not in before}
        assert fetch_weights(server.address, "p", 1, expect_sha256=sha, connections=4) == blob
    finally:
        server.close()
    encrypt = [seen[t] - ns for t, ns in served.items() if t in seen]
    decrypt = [ns for t, ns in seen.items() if t not in served and t not in before]
    # each connection's encryption (server) and decryption (puller) ran on a thread of its own: at
    # least three threads a side did a real share of the work (one connection may open late)
    for side in (encrypt, decrypt):
        assert sum(ns > max(side) / 4 for ns in side) >= 3, side

"""One blob's chunks pulled over a puller's connections: which connection carries which request, and
what happens when one drops, stays silent or delivers a chunk that fails its sha256.

Extra connections open one after another, each once the one before finished its handshake, so the
server has placed that one on an I/O thread and puts the next on another. A request goes to the
least loaded connection believed to deliver. The requests of a connection that drops (its monitor
says so) or leaves one unanswered for the resend interval go to the front of the queue for the
others; a connection that delivers a chunk failing its sha256 gets no more requests and the chunk is
asked again elsewhere, and only when every connection the pull may open did so does it fail.

The loop itself only moves requests and frames: each chunk's bytes are received as libzmq holds them
(no copy) and copied into place and hashed by the hashing threads (both release the GIL), so a pull
over several connections copies and checks on several cores. A pull that ends, even by an error,
first waits for those copies: the destination is never written after `run` returns.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

import numpy as np
import zmq

from astraflow import log
from astraflow.errors import ProtocolError, WeightIntegrityError
from astraflow.protocol.messages import Msg, WeightChunk, WeightManifest, WeightRequest
from astraflow.weights.connection import PullConnection
from astraflow.weights.manifest import chunk_span, hash_pool

if TYPE_CHECKING:
    from astraflow.weights.client import _Puller

_log = log.get("weights.chunk_pull")

CONNECTION_BYTES = 16 << 20
"""A pull opens one more connection per this many bytes of a blob, up to its `connections`: a
connection costs a handshake (a few round trips), worth it only when it then carries several chunks."""


class ChunkPull:
    """The state of one blob's chunk requests across the puller's connections."""

    def __init__(
        self, puller: _Puller, manifest: WeightManifest, kind: str, window: int, dest: memoryview
    ) -> None:
        """Pull every chunk of `manifest` into `dest`, up to `window` requests a connection."""
        self.puller = puller
        self.manifest = manifest
        self.kind = kind
        self.window = window
        self.dest = dest
        n = len(manifest.chunk_sha256)
        self.want = min(puller.connections, max(1, -(-manifest.nbytes // CONNECTION_BYTES)))
        self.pending = deque(range(n))
        self.got = [False] * n
        self.remaining = n
        self.inflight: dict[int, tuple[int, PullConnection, float]] = {}  # rid -> (chunk, conn, resend at)
        self.checks: deque[tuple[int, PullConnection, Future[str]]] = deque()
        self.poller = zmq.Poller()
        for conn in puller.conns:
            conn.load = 0
            conn.events()
            self._watch(conn)

    def run(self) -> None:
        """Until every chunk arrived and passed its sha256, or an error."""
        try:
            self._run()
        finally:
            wait([f for _, _, f in self.checks])  # no copy into dest outlives the pull

    def _run(self) -> None:
        p = self.puller
        while True:
            self._settle()
            if self.remaining == 0:
                return
            now = time.monotonic()
            if now >= min(p.deadline, p.last_heard + p.idle_s):
                m = self.manifest
                raise p.timeout_error(f"all {len(self.got)} chunks of {m.policy}@{m.version}")
            if len(p.conns) < self.want and p.conns[-1].handshaken:
                self._watch(p.open())
            for conn in p.conns:
                self._requeue(conn, due=now)
            while self.pending and (conn_or_none := self._pick()) is not None:
                self._ask(self.pending.popleft(), conn_or_none)
            next_resend = min((t for _, _, t in self.inflight.values()), default=p.deadline)
            wait_s = min(p.deadline, next_resend, p.last_heard + p.idle_s) - now
            ready = dict(self.poller.poll(max(0, int(wait_s * 1000))))
            for conn in list(p.conns):
                while conn.sock in ready and (msg := conn.recv(0)) is not None:
                    p.last_heard = time.monotonic()
                    self._take(conn, msg)
                if conn.monitor in ready and conn.events():
                    self._requeue(conn)  # the link dropped: the replies it carried are lost with it

    def _watch(self, conn: PullConnection) -> None:
        self.poller.register(conn.sock, zmq.POLLIN)
        self.poller.register(conn.monitor, zmq.POLLIN)

    def _settle(self) -> None:
        """Collect finished chunk checks (all of them, waiting, once every chunk arrived)."""
        while self.checks and (self.remaining == 0 or self.checks[0][2].done()):
            index, conn, digest = self.checks.popleft()
            if digest.result() != self.manifest.chunk_sha256[index]:
                self._retire(conn, index)
                self._requeue(conn)
                self.got[index] = False
                self.remaining += 1
                self.pending.appendleft(index)

    def _ask(self, index: int, conn: PullConnection) -> None:
        m = self.manifest
        req = WeightRequest(
            rid=next(self.puller.rids), policy=m.policy, version=m.version, chunk=index, kind=self.kind
        )
        self.inflight[req.rid] = (index, conn, time.monotonic() + self.puller.retry_s)
        conn.load += 1
        conn.send(req)

    def _requeue(self, conn: PullConnection, *, due: float | None = None) -> None:
        """Its requests (with `due` = now: only those unanswered past their resend time, which also
        marks it as not delivering) go to the front of the queue."""
        for rid, (index, c, at) in list(self.inflight.items()):
            if c is conn and (due is None or due >= at):
                del self.inflight[rid]
                conn.load -= 1
                self.pending.appendleft(index)
                if due is not None:
                    conn.ok = False

    def _take(self, conn: PullConnection, msg: Msg) -> None:
        """One reply from `conn`: a chunk received in place and its check started, or an error."""
        m, addr = self.manifest, self.puller.addr
        entry = self.inflight.pop(msg.rid, None)
        if entry is None:
            if isinstance(msg, WeightChunk):
                conn.data(None)
            return  # a late answer to a request already asked again
        index = entry[0]
        conn.load -= 1
        self.puller.check_error(msg, m.policy, m.version)
        if not isinstance(msg, WeightChunk) or msg.index != index:
            if isinstance(msg, WeightChunk):
                conn.data(None)
            raise ProtocolError(
                f"weight server at {addr} answered chunk {index} with {type(msg).__name__}", hint=""
            )
        start, end = chunk_span(m, index)
        if self.got[index]:
            conn.data(None)
            return
        frame = conn.frame()
        if msg.nbytes != end - start or len(frame) != end - start:
            raise WeightIntegrityError(
                f"chunk {index} of {m.policy}@{m.version} from {addr} has the wrong size",
                hint="the server or the network corrupted it; retry, or pull from another peer",
            )
        self.got[index] = True
        self.remaining -= 1
        self.checks.append((index, conn, hash_pool().submit(_place, frame, self.dest[start:end])))

    def _pick(self) -> PullConnection | None:
        """The connection for the next request: the least loaded one believed to deliver, else (none
        is) the least loaded of the rest, as a probe; None while every candidate is full."""
        usable = [c for c in self.puller.conns if not c.retired]
        candidates = [c for c in usable if c.ok] or usable
        free = [c for c in candidates if c.load < self.window]
        return min(free, key=lambda c: c.load, default=None)

    def _retire(self, conn: PullConnection, index: int) -> None:
        """A chunk from `conn` failed its sha256: no more requests on it; raise when none is left."""
        m, conns = self.manifest, self.puller.conns
        conn.retired = True
        if all(c.retired for c in conns) and len(conns) >= self.want:
            raise WeightIntegrityError(
                f"chunk {index} of {m.policy}@{m.version} from {self.puller.addr} fails its sha256",
                hint="the server or the network corrupted it; retry, or pull from another peer",
            )
        _log.warning(
            "chunk %d of %s@%d from %s failed its sha256 on one connection: asking the others",
            index,
            m.policy,
            m.version,
            self.puller.addr,
        )


def _place(frame: zmq.Frame, dest: memoryview) -> str:
    """Copy a received chunk into its place and return the hex sha256 of what landed there."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(frame.buffer, dtype=np.uint8))
    return hashlib.sha256(dest).hexdigest()

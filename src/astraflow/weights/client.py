"""Pull one weight version from a weight server: manifest, then chunks with a few in flight, verified."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time

import zmq
from zmq.utils import z85

from astraflow.errors import AstraflowError, ConnectError, ProtocolError, WeightIntegrityError
from astraflow.protocol.messages import Error, Msg, WeightChunk, WeightManifest, WeightRequest
from astraflow.weights.chunk_pull import ChunkPull
from astraflow.weights.connection import PullConnection
from astraflow.weights.manifest import LEAF_BYTES, blob_digest, check_manifest

DEFAULT_WINDOW = 8
"""Chunk requests kept in flight on each connection: enough to hide a round trip, few enough not to
flood the server."""


def default_connections() -> int:
    """Connections a pull spreads over unless told: min(4, this machine's cores)."""
    return max(1, min(4, os.cpu_count() or 1))


class VersionUnavailableError(AstraflowError):
    """The weight server no longer (or never) held the requested version; pull a newer one."""


class NotYetError(VersionUnavailableError):
    """A relay is still fetching the requested version: ask it again shortly, or pull elsewhere."""


def fetch_manifest(
    addr: str, policy: str, version: int, *, kind: str = "full", timeout_s: float = 10.0
) -> WeightManifest:
    """Ask a weight server for a version's manifest only."""
    with _Puller(addr, timeout_s, max_chunk_bytes=1 << 30) as puller:
        return puller.manifest(policy, version, kind)


def fetch_weights(
    addr: str,
    policy: str,
    version: int,
    *,
    timeout_s: float = 60,
    kind: str = "full",
    expect_sha256: str = "",
    window: int = DEFAULT_WINDOW,
    max_chunk_bytes: int = 64 << 20,
    idle_timeout_s: float | None = None,
    into: RecvBuffers | None = None,
    connections: int = 0,
) -> memoryview:
    """Download and verify a version's blob (a writable buffer, from `into` when given: give it back
    there once read) over up to `connections` connections (0: default_connections()), each its own
    CURVE session on its own I/O thread; WeightIntegrityError on any checksum mismatch that no
    other connection could repair.

    Raises ConnectError when the server does not answer within timeout_s (for the whole pull) and
    VersionUnavailableError when it does not hold the version; with idle_timeout_s, ConnectError as
    soon as the server was silent that long.
    """
    conns = connections or default_connections()
    with _Puller(addr, timeout_s, max_chunk_bytes, idle_timeout_s, conns) as puller:
        manifest = puller.manifest(policy, version, kind)
        if expect_sha256 and manifest.sha256 != expect_sha256:
            raise WeightIntegrityError(
                f"{policy}@{version} from {addr} has sha256 {manifest.sha256[:12]}…, expected {expect_sha256[:12]}…",
                hint="the server holds different bytes for this version; pull from the trainer instead",
            )
        return _pull_blob(puller, manifest, kind, window, max_chunk_bytes, into)


def fetch_chain(
    addr: str,
    policy: str,
    base: int,
    version: int,
    *,
    max_bytes: int,
    timeout_s: float = 60,
    window: int = DEFAULT_WINDOW,
    max_chunk_bytes: int = 64 << 20,
    idle_timeout_s: float | None = None,
    connections: int = 0,
) -> list[memoryview]:
    """Download and verify the deltas base+1 .. version (each from the version before), in order,
    over up to `connections` connections as fetch_weights.

    Raises VersionUnavailableError when the server lacks one of them, or when together they exceed
    max_bytes (a full snapshot is then the cheaper pull); ConnectError and WeightIntegrityError as
    fetch_weights.
    """
    if version <= base:
        raise ValueError(f"no chain from {base} to {version}")
    conns = connections or default_connections()
    with _Puller(addr, timeout_s, max_chunk_bytes, idle_timeout_s, conns) as puller:
        manifests = [puller.manifest(policy, v, "delta") for v in range(base + 1, version + 1)]
        total = sum(m.nbytes for m in manifests)
        if total > max_bytes:
            raise VersionUnavailableError(
                f"the deltas {policy}@{base}..{version} at {addr} total {total} bytes, over {max_bytes}",
                hint="pull the full version",
            )
        return [_pull_blob(puller, m, "delta", window, max_chunk_bytes) for m in manifests]


def _pull_blob(
    puller: _Puller,
    manifest: WeightManifest,
    kind: str,
    window: int,
    max_chunk_bytes: int,
    into: RecvBuffers | None = None,
) -> memoryview:
    policy, version, addr = manifest.policy, manifest.version, puller.addr
    problem = check_manifest(manifest, max_chunk_bytes)
    if problem:
        raise ProtocolError(f"bad manifest for {policy}@{version} from {addr}: {problem}", hint="")
    view = (into or RecvBuffers(0)).take(manifest.nbytes)
    try:
        puller.chunks(manifest, kind, max(1, window), view)
        # chunks of LEAF_BYTES are the digest's leaves, checked above against the manifest's digest:
        # their checks proved the blob; other chunk sizes need one more (parallel) pass
        if manifest.chunk_bytes != LEAF_BYTES and blob_digest(view) != manifest.sha256:
            raise WeightIntegrityError(
                f"{kind} {policy}@{version} from {addr}: whole-blob digest mismatch", hint="retry the pull"
            )
    except BaseException:
        if into is not None:
            into.give(view)
        raise
    return view


class RecvBuffers:
    """Receive buffers kept for reuse: a fresh buffer costs the kernel a page fault per 4 KiB on first
    write, about as long as the transfer itself; a reused one costs nothing. Keeps at most `keep`."""

    def __init__(self, keep: int = 2) -> None:
        """Hold up to `keep` returned buffers (0: never reuse)."""
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly nbytes: a returned one of that size, or a fresh mapping whose
        pages the kernel fills in one call (MAP_POPULATE), not one fault at a time."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) == max(1, nbytes):
                    return memoryview(self._free.pop(i))[:nbytes]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return memoryview(mmap.mmap(-1, max(1, nbytes), flags=flags))[:nbytes]

    def give(self, view: memoryview) -> None:
        """Return a buffer from `take` once nothing reads it any more."""
        buf = view.obj
        if isinstance(buf, mmap.mmap):
            with self._lock:
                if len(self._free) < self.keep:
                    self._free.append(buf)


def split_address(addr: str) -> tuple[str, bytes | None]:
    """A weight server address -> (zmq endpoint, its CURVE public key as Z85, or None if plain)."""
    endpoint, _, fragment = addr.partition("#")
    if not fragment:
        return endpoint, None
    name, _, value = fragment.partition("=")
    try:
        raw = bytes.fromhex(value)
        if name != "curve" or len(raw) != 32:
            raise ValueError(value)
    except ValueError:
        raise ProtocolError(
            f"weight server address {addr!r} has a bad key part",
            hint="expected tcp://HOST:PORT#curve=<64 hex>",
        ) from None
    return endpoint, z85.encode(raw)


class _Puller:
    """Connections to one weight server (one at first; more, each on its own libzmq I/O thread, once
    a blob is big enough), with a deadline shared by every request of a pull."""

    def __init__(
        self,
        addr: str,
        timeout_s: float,
        max_chunk_bytes: int,
        idle_timeout_s: float | None = None,
        connections: int = 1,
    ) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.idle_s = idle_timeout_s or timeout_s
        """Give up when the server sent nothing for this long (a relay that died mid-transfer)."""
        self.last_heard = time.monotonic()
        # a lost request (server restarted, peer dropped) is asked again after this long
        self.retry_s = max(0.5, min(5.0, timeout_s / 6))
        self.rids = itertools.count(1)
        self.connections = max(1, connections)
        self.max_chunk_bytes = max_chunk_bytes
        self.endpoint, self.server_key = split_address(addr)
        self.ctx = zmq.Context(io_threads=self.connections)
        self.conns: list[PullConnection] = []
        self.open()

    def __enter__(self) -> _Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self.conns:
            conn.close()
        self.ctx.term()

    def timeout_error(self, what: str) -> ConnectError:
        """The error of a pull that did not get `what` in time."""
        return ConnectError(
            f"weight server at {self.addr} did not send {what} within {self.timeout_s:g}s",
            hint="is the trainer (or relaying RaaS) still running, and is its port reachable from here?",
        )

    def check_error(self, msg: Msg, policy: str, version: int) -> None:
        """Raise the error an Error reply stands for (nothing for any other reply)."""
        if isinstance(msg, Error):
            if msg.code == "not_yet":
                raise NotYetError(f"weight server at {self.addr}: {msg.message}", hint="ask again shortly")
            if msg.code == "unknown_version":
                raise VersionUnavailableError(
                    f"weight server at {self.addr} does not hold {policy}@{version}: {msg.message}",
                    hint="a newer version was published; pull that one",
                )
            raise ProtocolError(f"weight server at {self.addr} answered {msg.code}: {msg.message}", hint="")

    def manifest(self, policy: str, version: int, kind: str) -> WeightManifest:
        """Ask for a manifest on the first connection, again every retry_s until the deadline."""
        conn = self.conns[0]
        req = WeightRequest(rid=next(self.rids), policy=policy, version=version, kind=kind)
        conn.send(req)
        resend_at = time.monotonic() + self.retry_s
        while True:
            now = time.monotonic()
            if now >= min(self.deadline, self.last_heard + self.idle_s):
                raise self.timeout_error(f"the manifest of {policy}@{version}")
            if now >= resend_at:
                conn.send(req)
                resend_at = now + self.retry_s
            msg = conn.recv(min(self.deadline, resend_at, self.last_heard + self.idle_s) - now)
            if msg is not None:
                self.last_heard = time.monotonic()
            if isinstance(msg, WeightChunk):
                conn.data(None)  # a late answer to an earlier pull's chunk request
            if msg is None or msg.rid != req.rid:
                continue
            self.check_error(msg, policy, version)
            if not isinstance(msg, WeightManifest) or (msg.policy, msg.version) != (policy, version):
                raise ProtocolError(
                    f"weight server at {self.addr} answered a manifest request with {msg!r:.120}", hint=""
                )
            return msg

    def chunks(self, manifest: WeightManifest, kind: str, window: int, dest: memoryview) -> None:
        """Fill `dest` with every chunk over this puller's connections (weights/chunk_pull.py), each
        received in place and its sha256 checked on the hashing threads while the next arrive."""
        ChunkPull(self, manifest, kind, window, dest).run()

    def open(self) -> PullConnection:
        """One more connection to the server."""
        conn = PullConnection(self.ctx, self.endpoint, self.server_key, self.addr, self.max_chunk_bytes)
        self.conns.append(conn)
        return conn

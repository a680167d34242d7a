"""Pull one weight version from a weight server: manifest, then chunks with a few in flight, verified."""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import zmq
from zmq.utils import z85

from astraflow.errors import AstraflowError, ConnectError, ProtocolError, WeightIntegrityError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import Error, Msg, WeightChunk, WeightManifest, WeightRequest
from astraflow.transport.keys import KeyPair
from astraflow.transport.security import curve_client, member_credentials
from astraflow.weights.manifest import LEAF_BYTES, blob_digest, check_manifest, chunk_span, hash_pool

DEFAULT_WINDOW = 8
"""Chunk requests kept in flight: enough to hide a round trip, few enough not to flood the server."""


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
) -> memoryview:
    """Download and verify a version's blob (a writable buffer, from `into` when given: give it back
    there once read); WeightIntegrityError on any checksum mismatch.

    Raises ConnectError when the server does not answer within timeout_s (for the whole pull) and
    VersionUnavailableError when it does not hold the version; with idle_timeout_s, ConnectError as
    soon as the server was silent that long.
    """
    with _Puller(addr, timeout_s, max_chunk_bytes, idle_timeout_s) as puller:
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
) -> list[memoryview]:
    """Download and verify the deltas base+1 .. version (each from the version before), in order.

    Raises VersionUnavailableError when the server lacks one of them, or when together they exceed
    max_bytes (a full snapshot is then the cheaper pull); ConnectError and WeightIntegrityError as
    fetch_weights.
    """
    if version <= base:
        raise ValueError(f"no chain from {base} to {version}")
    with _Puller(addr, timeout_s, max_chunk_bytes, idle_timeout_s) as puller:
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
    """One DEALER to one weight server, with a deadline shared by every request of a pull."""

    def __init__(
        self, addr: str, timeout_s: float, max_chunk_bytes: int, idle_timeout_s: float | None = None
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
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_chunk_bytes + (64 << 10))
        self.sock.setsockopt(zmq.ROUTING_ID, b"w-" + os.urandom(8).hex().encode())
        endpoint, server_key = split_address(addr)
        if server_key is not None:
            creds = member_credentials()
            # without member credentials (a test, a tool) a throwaway key pair still encrypts and
            # checks the server; a server restricted to member keys then refuses it
            pair = creds.keypair if creds is not None else KeyPair(*zmq.curve_keypair())
            curve_client(self.sock, pair, server_key)
        self.sock.connect(endpoint)

    def __enter__(self) -> _Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close(0)
        self.ctx.term()

    def _send(self, req: WeightRequest) -> None:
        try:
            self.sock.send(encode(req), zmq.NOBLOCK)
        except zmq.Again:
            # no connection to queue to (a refused CURVE handshake drops it): the request is
            # re-sent after retry_s, and the pull fails with ConnectError at its deadline
            pass

    def _recv(self, wait_s: float) -> Msg | None:
        """The next reply's first frame, decoded; a WeightChunk's bytes are left for `_data`."""
        if not self.sock.poll(max(0, int(wait_s * 1000))):
            return None
        head = self.sock.recv(copy=False)
        self.last_heard = time.monotonic()
        try:
            msg = decode(head.buffer)
        except DecodeError as exc:
            self._skip_rest()
            raise ProtocolError(
                f"weight server {self.addr} sent an undecodable reply: {exc}", hint=""
            ) from None
        if isinstance(msg, WeightChunk) != bool(head.more):
            self._skip_rest()
            raise ProtocolError(f"weight server {self.addr} sent a reply with the wrong frames", hint="")
        return msg

    def _skip_rest(self) -> None:
        """Drop the remaining frames of the current reply."""
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(copy=False)

    def _data(self, dest: memoryview | None) -> int:
        """Receive a WeightChunk's bytes straight into `dest` (None: drop them); their length."""
        if dest is None:
            n = len(self.sock.recv(copy=False))
        else:
            n = self.sock.recv_into(dest)
        if self.sock.getsockopt(zmq.RCVMORE):
            self._skip_rest()
            raise ProtocolError(f"weight server {self.addr} sent a chunk with extra frames", hint="")
        return n

    def _timeout(self, what: str) -> ConnectError:
        return ConnectError(
            f"weight server at {self.addr} did not send {what} within {self.timeout_s:g}s",
            hint="is the trainer (or relaying RaaS) still running, and is its port reachable from here?",
        )

    def _check_error(self, msg: Msg, policy: str, version: int) -> None:
        if isinstance(msg, Error):
            if msg.code == "not_yet":
                raise NotYetError(f"relay at {self.addr}: {msg.message}", hint="ask again shortly")
            if msg.code == "unknown_version":
                raise VersionUnavailableError(
                    f"weight server at {self.addr} does not hold {policy}@{version}: {msg.message}",
                    hint="a newer version was published; pull that one",
                )
            raise ProtocolError(f"weight server at {self.addr} answered {msg.code}: {msg.message}", hint="")

    def manifest(self, policy: str, version: int, kind: str) -> WeightManifest:
        req = WeightRequest(rid=next(self.rids), policy=policy, version=version, kind=kind)
        self._send(req)
        resend_at = time.monotonic() + self.retry_s
        while True:
            now = time.monotonic()
            if now >= min(self.deadline, self.last_heard + self.idle_s):
                raise self._timeout(f"the manifest of {policy}@{version}")
            if now >= resend_at:
                self._send(req)
                resend_at = now + self.retry_s
            msg = self._recv(min(self.deadline, resend_at, self.last_heard + self.idle_s) - now)
            if isinstance(msg, WeightChunk):
                self._data(None)  # a late answer to an earlier pull's chunk request
            if msg is None or msg.rid != req.rid:
                continue
            self._check_error(msg, policy, version)
            if not isinstance(msg, WeightManifest) or (msg.policy, msg.version) != (policy, version):
                raise ProtocolError(
                    f"weight server at {self.addr} answered a manifest request with {msg!r:.120}", hint=""
                )
            return msg

    def chunks(self, manifest: WeightManifest, kind: str, window: int, dest: memoryview) -> None:
        """Fill `dest` with every chunk, `window` requests in flight, each chunk received in place and
        its sha256 checked on the hashing threads while the next ones arrive."""
        n = len(manifest.chunk_sha256)
        got = [False] * n
        inflight: dict[int, tuple[int, float]] = {}  # rid -> (chunk index, resend time)
        todo = iter(range(n))
        remaining = n
        checks: deque[tuple[int, Future[str]]] = deque()
        pool = hash_pool()

        def ask(index: int) -> None:
            req = WeightRequest(
                rid=next(self.rids), policy=manifest.policy, version=manifest.version, chunk=index, kind=kind
            )
            inflight[req.rid] = (index, time.monotonic() + self.retry_s)
            self._send(req)

        for index in itertools.islice(todo, window):
            ask(index)
        while remaining:
            now = time.monotonic()
            if now >= min(self.deadline, self.last_heard + self.idle_s):
                raise self._timeout(f"all {n} chunks of {manifest.policy}@{manifest.version}")
            for rid, (index, resend_at) in list(inflight.items()):
                if now >= resend_at:
                    del inflight[rid]
                    ask(index)
            next_resend = min((t for _, t in inflight.values()), default=self.deadline)
            msg = self._recv(min(self.deadline, next_resend, self.last_heard + self.idle_s) - now)
            if msg is None:
                continue
            entry = inflight.pop(msg.rid, None)
            if entry is None:
                if isinstance(msg, WeightChunk):
                    self._data(None)
                continue  # a late answer to a request we already re-sent
            self._check_error(msg, manifest.policy, manifest.version)
            index = entry[0]
            if not isinstance(msg, WeightChunk) or msg.index != index:
                if isinstance(msg, WeightChunk):
                    self._data(None)
                raise ProtocolError(
                    f"weight server at {self.addr} answered chunk {index} with {type(msg).__name__}", hint=""
                )
            start, end = chunk_span(manifest, index)
            if got[index]:
                self._data(None)
            elif msg.nbytes != end - start or self._data(dest[start:end]) != end - start:
                if msg.nbytes != end - start:
                    self._data(None)
                raise WeightIntegrityError(
                    f"chunk {index} of {manifest.policy}@{manifest.version} from {self.addr} has the wrong size",
                    hint="the server or the network corrupted it; retry, or pull from another peer",
                )
            else:
                got[index] = True
                remaining -= 1
                checks.append((index, pool.submit(_sha_hex, dest[start:end])))
                while checks and checks[0][1].done():
                    self._check_chunk(manifest, *checks.popleft())
            nxt = next(todo, None)
            if nxt is not None:
                ask(nxt)
        while checks:
            self._check_chunk(manifest, *checks.popleft())

    def _check_chunk(self, manifest: WeightManifest, index: int, digest: Future[str]) -> None:
        if digest.result() != manifest.chunk_sha256[index]:
            raise WeightIntegrityError(
                f"chunk {index} of {manifest.policy}@{manifest.version} from {self.addr} fails its sha256",
                hint="the server or the network corrupted it; retry, or pull from another peer",
            )


def _sha_hex(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()

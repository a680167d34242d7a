"""Pull one weight version from a weight server: manifest, then chunks with a few in flight, verified."""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import threading
import time

import zmq
from zmq.utils import z85

from astraflow.errors import AstraflowError, ConnectError, ProtocolError, WeightIntegrityError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import Error, Msg, WeightChunk, WeightManifest, WeightRequest
from astraflow.transport.keys import KeyPair
from astraflow.transport.security import curve_client, member_credentials
from astraflow.weights.manifest import check_manifest, chunk_span

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
) -> memoryview:
    """Download and verify a version's blob (a writable buffer); WeightIntegrityError on any
    checksum mismatch.

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
        return _pull_blob(puller, manifest, kind, window, max_chunk_bytes)


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
    puller: _Puller, manifest: WeightManifest, kind: str, window: int, max_chunk_bytes: int
) -> memoryview:
    policy, version, addr = manifest.policy, manifest.version, puller.addr
    problem = check_manifest(manifest, max_chunk_bytes)
    if problem:
        raise ProtocolError(f"bad manifest for {policy}@{version} from {addr}: {problem}", hint="")
    # chunks land in place in one buffer (anonymous mmap: no zeroing pass), while a second thread
    # hashes the whole blob as its prefix fills, so the digest is ready when the last chunk is
    blob = mmap.mmap(-1, max(1, manifest.nbytes))
    view = memoryview(blob)[: manifest.nbytes]
    digest = _PrefixHasher(view)
    try:
        puller.chunks(manifest, kind, max(1, window), view, digest)
    finally:
        whole = digest.finish()
    if whole != manifest.sha256:
        raise WeightIntegrityError(
            f"{kind} {policy}@{version} from {addr}: whole-blob sha256 mismatch", hint="retry the pull"
        )
    return view


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
        if not self.sock.poll(max(0, int(wait_s * 1000))):
            return None
        frames = self.sock.recv_multipart()
        self.last_heard = time.monotonic()
        if len(frames) != 1:
            raise ProtocolError(f"weight server {self.addr} sent {len(frames)} frames", hint="")
        try:
            return decode(frames[0])
        except DecodeError as exc:
            raise ProtocolError(
                f"weight server {self.addr} sent an undecodable reply: {exc}", hint=""
            ) from None

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
            if msg is None or msg.rid != req.rid:
                continue
            self._check_error(msg, policy, version)
            if not isinstance(msg, WeightManifest) or (msg.policy, msg.version) != (policy, version):
                raise ProtocolError(
                    f"weight server at {self.addr} answered a manifest request with {msg!r:.120}", hint=""
                )
            return msg

    def chunks(
        self, manifest: WeightManifest, kind: str, window: int, dest: memoryview, digest: _PrefixHasher
    ) -> None:
        n = len(manifest.chunk_sha256)
        got = [False] * n
        inflight: dict[int, tuple[int, float]] = {}  # rid -> (chunk index, resend time)
        todo = iter(range(n))
        remaining = n

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
                continue  # a late answer to a request we already re-sent
            self._check_error(msg, manifest.policy, manifest.version)
            index = entry[0]
            if not isinstance(msg, WeightChunk) or msg.index != index:
                raise ProtocolError(
                    f"weight server at {self.addr} answered chunk {index} with {type(msg).__name__}", hint=""
                )
            start, end = chunk_span(manifest, index)
            if (
                len(msg.data) != end - start
                or hashlib.sha256(msg.data).hexdigest() != manifest.chunk_sha256[index]
            ):
                raise WeightIntegrityError(
                    f"chunk {index} of {manifest.policy}@{manifest.version} from {self.addr} fails its sha256",
                    hint="the server or the network corrupted it; retry, or pull from another peer",
                )
            if not got[index]:
                dest[start:end] = msg.data
                got[index] = True
                remaining -= 1
                digest.arrived(index, end)
            nxt = next(todo, None)
            if nxt is not None:
                ask(nxt)


class _PrefixHasher:
    """sha256 of a buffer filled out of order, hashed on a thread up to the longest filled prefix."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.hash = hashlib.sha256()
        self.done: dict[int, int] = {}  # chunk index -> its end, for chunks past the prefix
        self.next_index = 0
        self.filled = 0  # bytes [0, filled) are all in place
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="astraflow-weights-hash", daemon=True)
        self.thread.start()

    def arrived(self, index: int, end: int) -> None:
        """Chunk `index`, ending at byte `end`, is in place."""
        with self.cond:
            self.done[index] = end
            while self.next_index in self.done:
                self.filled = self.done.pop(self.next_index)
                self.next_index += 1
            self.cond.notify()

    def _run(self) -> None:
        hashed = 0
        while True:
            with self.cond:
                while self.filled == hashed and not self.closed:
                    self.cond.wait()
                upto, closed = self.filled, self.closed
            if upto > hashed:
                self.hash.update(self.view[hashed:upto])  # hashlib releases the GIL on big buffers
                hashed = upto
            elif closed:
                return

    def finish(self) -> str:
        """The digest of the prefix filled so far (the whole blob after a complete pull)."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()
        return self.hash.hexdigest()

"""Serve published weight blobs (manifest + chunks) from a ROUTER on a background thread."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import msgspec
import zmq
from zmq.utils import z85

from astraflow import log
from astraflow.errors import ConnectError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import Error, Msg, WeightChunk, WeightManifest, WeightRequest
from astraflow.transport.keys import KeyPair, KeyStore
from astraflow.transport.security import curve_server, member_credentials
from astraflow.transport.server import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from astraflow.weights.manifest import LEAF_BYTES, build_manifest, chunk_span
from astraflow.weights.pull_limit import PullLimit

_log = log.get("weights.server")

_MAX_REQUEST_BYTES = 64 << 10
"""Requests are tiny; a bigger frame is an attack or a bug and drops the peer."""
SNDHWM = 16
"""Replies queued per peer: twice a puller's window. A peer that asks for more and does not read
gets the rest dropped (it re-asks after its retry time), so a peer holds at most SNDHWM chunks."""
_MAX_DRAIN = 256
"""Requests handled per poll turn, so the stop flag is seen even under a flood."""

_pull_keys: KeyStore | None = None


def set_pull_keys(keys: KeyStore | None) -> None:
    """Restrict this process's weight servers to the member keys of a key store (the CLI's --keys)."""
    global _pull_keys
    _pull_keys = keys


def key_suffix(public_z85: bytes) -> str:
    """What a CURVE weight server appends to its address: '#curve=' and its public key in hex."""
    return "#curve=" + z85.decode(public_z85).hex()


class WeightServer:
    """Holds the newest `keep_versions` versions per policy and serves them to any puller.

    Used by trainers for their own versions. With a key pair (default: this process's member
    credentials) it is a CURVE server and `address` ends in '#curve=<hex public key>', so a puller
    that got the address from the controller also knows which key the server must prove; with
    pull_keys only that key store's non-revoked raas and trainer keys may connect (default: any CURVE key).
    """

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        *,
        chunk_bytes: int = LEAF_BYTES,
        keep_versions: int = 2,
        keep_deltas: int = 0,
        relay: bool = False,
        port: int = 0,
        advertise_host: str | None = None,
        keypair: KeyPair | None = None,
        pull_keys: KeyStore | None = None,
        io_threads: int = 0,
    ) -> None:
        """Bind on bind_host (port 0 = a free one) and start serving; `address` is what peers dial.
        io_threads: libzmq I/O threads (0: min(4, cores)); each connection's CURVE encryption runs
        on one of them, so a pull over several connections encrypts on several cores."""
        if chunk_bytes <= 0 or keep_versions <= 0 or keep_deltas < 0:
            raise ValueError("chunk_bytes and keep_versions must be positive, keep_deltas not negative")
        self.chunk_bytes = chunk_bytes
        self.keep_versions = keep_versions
        self.keep_deltas = keep_deltas
        """Deltas held per policy at most (each from the version before); also no more, together,
        than the newest full version's size: a longer chain would cost a puller more than a full."""
        self.relay = relay
        """A worker's relay: a request for a version newer than any it holds is answered `not_yet`
        (it pulls every new version, so the asker may wait for it) rather than `unknown_version`."""
        self._blobs: dict[tuple[str, int, str], tuple[WeightManifest, memoryview]] = {}
        self._coming: set[tuple[str, int]] = set()
        """(policy, version) whose delta is being encoded: asked for, it is answered `not_yet`."""
        self._lock = threading.Lock()
        self._limit = PullLimit()
        """Connections served per key (weights/pull_limit.py)."""
        self._ctx = zmq.Context(io_threads=io_threads or max(1, min(4, os.cpu_count() or 1)))
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        creds = member_credentials()
        keypair = keypair or (creds.keypair if creds is not None else None)
        pull_keys = pull_keys or _pull_keys
        self._auth = None
        if keypair is not None:
            allow = None if pull_keys is None else pull_keys.admits_puller
            self._auth = curve_server(self._ctx, sock, keypair, allow)
        try:
            if port:
                sock.bind(f"tcp://{bind_host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise ConnectError(f"weight server cannot bind {bind_host}:{port}: {exc}", hint="") from None
        self.address: str = f"tcp://{advertise_host or bind_host}:{port}" + (
            key_suffix(keypair.public) if keypair is not None else ""
        )
        """Endpoint peers connect to (advertise_host when binding a wildcard address)."""
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="astraflow-weights", daemon=True)
        self._thread.start()

    def publish(
        self, policy: str, version: int, blob: bytes | memoryview, *, kind: str = "full"
    ) -> WeightManifest:
        """Checksum and hold a blob (kind "full", or "delta" from version - 1), evicting full versions
        older than the newest keep_versions and deltas past keep_deltas or the newest full's size."""
        if kind not in ("full", "delta"):
            raise ValueError(f"unknown blob kind {kind!r}")
        manifest = build_manifest(policy, version, blob, self.chunk_bytes, kind=kind)
        with self._lock:
            self._blobs[(policy, version, kind)] = (manifest, memoryview(blob).cast("B"))
            if kind == "delta":
                self._coming.discard((policy, version))
            self._evict(policy)
        return manifest

    def delta_coming(self, policy: str, version: int, coming: bool = True) -> None:
        """Say that the delta of `policy@version` is being encoded (a request for it is answered
        `not_yet`, so a worker may wait for it rather than pull the full version), or no longer is."""
        with self._lock:
            if coming:
                self._coming.add((policy, version))
            else:
                self._coming.discard((policy, version))

    def _evict(self, policy: str) -> None:
        fulls = sorted((v for (p, v, k) in self._blobs if p == policy and k == "full"), reverse=True)
        drop = [(policy, v, "full") for v in fulls[self.keep_versions :]]
        budget = self._blobs[(policy, fulls[0], "full")][0].nbytes if fulls else 0
        kept = 0
        deltas = sorted((v for (p, v, k) in self._blobs if p == policy and k == "delta"), reverse=True)
        for i, v in enumerate(deltas):
            size = self._blobs[(policy, v, "delta")][0].nbytes
            if i >= self.keep_deltas or kept + size > budget:
                drop += [(policy, old, "delta") for old in deltas[i:]]
                break
            kept += size
        for key in drop:
            del self._blobs[key]

    def blob(self, policy: str, version: int, kind: str = "full") -> memoryview | None:
        """The bytes held for (policy, version, kind), or None."""
        with self._lock:
            entry = self._blobs.get((policy, version, kind))
        return None if entry is None else entry[1]

    def manifest(self, policy: str, version: int, kind: str = "full") -> WeightManifest | None:
        """The manifest held for (policy, version, kind), or None."""
        with self._lock:
            entry = self._blobs.get((policy, version, kind))
        return None if entry is None else entry[0]

    def deltas(self, policy: str) -> list[int]:
        """Versions of a policy whose delta (from the version before) this server holds, oldest first."""
        with self._lock:
            return sorted(v for (p, v, k) in self._blobs if p == policy and k == "delta")

    def held(self, policy: str) -> list[int]:
        """Full versions of a policy this server can serve now, oldest first."""
        with self._lock:
            return sorted(v for (p, v, k) in self._blobs if p == policy and k == "full")

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5.0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._serve_once()
                except Exception:  # no message may end the loop: log, and serve the next one
                    _log.exception("weight server: a request failed")
        finally:
            self._sock.close(0)

    def _serve_once(self) -> None:
        if not self._sock.poll(100):
            return
        for _ in range(_MAX_DRAIN):
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [f.bytes for f in parts]
            if not self._limit.admit(_key_of(parts[-1]), frames[0], time.monotonic()):
                continue  # too many connections of this key: nothing queued for this one
            try:
                reply, data = self._answer(frames)
            except Exception as exc:  # a bug in answering one request must not stop the server
                _log.exception("weight server: answering a request failed")
                reply, data = Error(code="internal", message=str(exc)[:200]), None
            out: list[Any] = [frames[0], encode(reply)]
            if data is not None:
                out.append(data)  # a chunk's bytes, as they are held: never encoded
            try:
                # a chunk goes out as a view of the held blob (no copy): a queued or dropped reply
                # holds no memory of its own, only keeps its version's blob alive until libzmq sends or
                # drops it (SNDHWM replies per peer at most). The small frames are copied by pyzmq.
                self._sock.send_multipart(out, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                pass  # the peer is gone or past its SNDHWM; it will ask again

    def _answer(self, frames: list[bytes]) -> tuple[Msg, memoryview | None]:
        """The reply to one request, and the chunk bytes that follow it as a second frame."""
        if len(frames) != 2:
            return Error(code="bad_message", message=f"expected 2 frames, got {len(frames)}"), None
        try:
            req = decode(frames[1])
        except DecodeError as exc:
            return Error(rid=exc.rid, code=exc.code, message=str(exc)[:500]), None
        if not isinstance(req, WeightRequest):
            what = type(req).__name__
            err = Error(rid=req.rid, code="unknown_type", message=f"a weight server does not answer {what}")
            return err, None
        with self._lock:
            entry = self._blobs.get((req.policy, req.version, req.kind))
            held = sorted(v for (p, v, k) in self._blobs if p == req.policy and k == "full")
            coming = req.kind == "delta" and (req.policy, req.version) in self._coming
        if entry is None and coming:
            return Error(
                rid=req.rid,
                code="not_yet",
                message=f"the delta of {req.policy}@{req.version} is being encoded",
            ), None
        if entry is None and self.relay and (not held or req.version > held[-1]):
            return Error(
                rid=req.rid,
                code="not_yet",
                message=f"this relay is still fetching {req.policy}@{req.version} (held: {held})",
            ), None
        if entry is None:
            return Error(
                rid=req.rid,
                code="unknown_version",
                message=f"{req.kind} {req.policy}@{req.version} not held here (held: {held})",
            ), None
        manifest, view = entry
        if req.chunk == -1:
            return msgspec.structs.replace(manifest, rid=req.rid), None
        if not 0 <= req.chunk < len(manifest.chunk_sha256):
            return Error(rid=req.rid, code="bad_message", message=f"no chunk {req.chunk}"), None
        start, end = chunk_span(manifest, req.chunk)
        head = WeightChunk(
            rid=req.rid, policy=req.policy, version=req.version, index=req.chunk, nbytes=end - start
        )
        return head, view[start:end]


def _key_of(frame: zmq.Frame) -> bytes:
    """The CURVE public key (z85) a frame came with; b'' on a plain socket."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return b""
    return user.encode() if isinstance(user, str) else b""

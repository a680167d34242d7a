"""Serve published weight blobs (manifest + chunks) from a ROUTER on a background thread."""

from __future__ import annotations

import threading

import msgspec
import zmq

from astraflow import log
from astraflow.errors import ConnectError
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.messages import Error, Msg, WeightChunk, WeightManifest, WeightRequest
from astraflow.weights.manifest import build_manifest, chunk_span

_log = log.get("weights.server")

_MAX_REQUEST_BYTES = 64 << 10
"""Requests are tiny; a bigger frame is an attack or a bug and drops the peer."""


class WeightServer:
    """Holds the newest `keep_versions` versions per policy and serves them to any puller.

    Used by trainers for their own versions and by RaaS workers to relay what they pulled.
    """

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        *,
        chunk_bytes: int = 4 << 20,
        keep_versions: int = 2,
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        """Bind on bind_host (port 0 = a free one) and start serving; `address` is what peers dial."""
        if chunk_bytes <= 0 or keep_versions <= 0:
            raise ValueError("chunk_bytes and keep_versions must be positive")
        self.chunk_bytes = chunk_bytes
        self.keep_versions = keep_versions
        self._blobs: dict[tuple[str, int, str], tuple[WeightManifest, memoryview]] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port:
                sock.bind(f"tcp://{bind_host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            raise ConnectError(f"weight server cannot bind {bind_host}:{port}: {exc}", hint="") from None
        self.address: str = f"tcp://{advertise_host or bind_host}:{port}"
        """Endpoint peers connect to (advertise_host when binding a wildcard address)."""
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="astraflow-weights", daemon=True)
        self._thread.start()

    def publish(self, policy: str, version: int, blob: bytes, *, kind: str = "full") -> WeightManifest:
        """Checksum and hold a blob, evicting versions older than the newest keep_versions."""
        manifest = build_manifest(policy, version, blob, self.chunk_bytes, kind=kind)
        with self._lock:
            self._blobs[(policy, version, kind)] = (manifest, memoryview(blob).cast("B"))
            held = sorted({v for (p, v, _) in self._blobs if p == policy}, reverse=True)
            drop = set(held[self.keep_versions :])
            for key in [k for k in self._blobs if k[0] == policy and k[1] in drop]:
                del self._blobs[key]
        return manifest

    def held(self, policy: str) -> list[int]:
        """Versions of a policy this server can serve now, oldest first."""
        with self._lock:
            return sorted({v for (p, v, _) in self._blobs if p == policy})

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5.0)
        self._ctx.term()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100):
                    continue
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self._answer(frames)
                    try:
                        self._sock.send_multipart([frames[0], encode(reply)], zmq.NOBLOCK, copy=False)
                    except zmq.ZMQError:
                        pass  # the peer is gone or not reading; it will ask again
        except Exception:
            _log.exception("weight server thread failed")
        finally:
            self._sock.close(0)

    def _answer(self, frames: list[bytes]) -> Msg:
        if len(frames) != 2:
            return Error(code="bad_message", message=f"expected 2 frames, got {len(frames)}")
        try:
            req = decode(frames[1])
        except DecodeError as exc:
            return Error(rid=exc.rid, code=exc.code, message=str(exc)[:500])
        if not isinstance(req, WeightRequest):
            what = type(req).__name__
            return Error(rid=req.rid, code="unknown_type", message=f"a weight server does not answer {what}")
        with self._lock:
            entry = self._blobs.get((req.policy, req.version, req.kind))
            held = sorted({v for (p, v, _) in self._blobs if p == req.policy})
        if entry is None:
            return Error(
                rid=req.rid,
                code="unknown_version",
                message=f"{req.kind} {req.policy}@{req.version} not held here (held: {held})",
            )
        manifest, view = entry
        if req.chunk == -1:
            return msgspec.structs.replace(manifest, rid=req.rid)
        if not 0 <= req.chunk < len(manifest.chunk_sha256):
            return Error(rid=req.rid, code="bad_message", message=f"no chunk {req.chunk}")
        start, end = chunk_span(manifest, req.chunk)
        # a memoryview slice is encoded straight from the held blob without an extra copy
        return WeightChunk(
            rid=req.rid,
            policy=req.policy,
            version=req.version,
            index=req.chunk,
            data=view[start:end],  # type: ignore[arg-type]  # msgspec encodes a memoryview as bytes
        )

"""Each version's delta, encoded beside the trainer and never in its way.

`BackgroundPublisher.start` hands every version to `DeltaEncoder.submit` and goes on; the full version
is held and announced as soon as it is served, and its delta (from the version before) follows when it
is ready, its metrics announced again for the same version (`take_late`). A worker that asks before
then is answered `not_yet` and waits for it at most `[weights] delta_wait_s`, then pulls the full
version (weights/fetch.py). One delta is encoded at a time and one
more waits its turn: a version submitted while another still waits replaces it (the one replaced gets
no delta, counted in `skipped`), so the trainer's next publish never waits for an encode.

Two paths, the same bytes (tests/unit/test_delta_encoder.py):
- **device**: the trainer's snapshot is on a GPU. The encoder keeps the previous version's snapshot
  there (the base) and compares on the device (weights/delta_device.py); only the changed elements
  cross to the host. Device memory: the base, one version, is kept between versions; while an encode
  runs it also holds the version being encoded and the one waiting (snapshots the trainer's host copy
  would otherwise free once copied), so at most three versions, and about 120 MiB of working memory
  (`delta_device.CHUNK_ELEMENTS`). After a replaced version the next one has no base on the device
  either: it gets no delta (counted too) and becomes the base.
- **host**: host snapshots (a CPU trainer, several ranks, LoRA). The encoder compares the two full
  blobs the weight server holds (views, no copy).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from astraflow import log
from astraflow.protocol.messages import WeightManifest
from astraflow.weights.server import WeightServer

_log = log.get("weights.delta")


@dataclass
class _Job:
    """One version's delta: submitted with its snapshot, told when its full version is served."""

    version: int
    weights: dict[str, Any]
    device: bool
    ready: Any
    """A CUDA event after the snapshot's kernels (device path), else None."""
    submitted: float = field(default_factory=time.monotonic)
    served: threading.Event = field(default_factory=threading.Event)
    manifest: WeightManifest | None = None
    """The full version's manifest, once served (None: its publish failed)."""
    blob: Any = None
    base: tuple[Any, WeightManifest] | None = None
    """Host path: the version before's blob and manifest, taken when this one is served."""


class DeltaEncoder:
    """Encodes and holds each version's delta on its own thread, one at a time."""

    def __init__(self, server: WeightServer, policy: str, *, on_device: bool | None = None) -> None:
        """Hold `policy`'s deltas in `server`; `on_device`: the path (None: the device path when the
        snapshot is on a GPU)."""
        self.server = server
        self.policy = policy
        self.on_device = on_device
        self.skipped = 0
        """Versions that got no delta because a newer one replaced them while they waited (and, on the
        device path, the version after each: its base was not kept)."""
        self._base: tuple[int, dict[str, Any], str] | None = None
        """Device path: the newest served version's snapshot and sha256 (the next delta's base)."""
        self._running: _Job | None = None
        self._waiting: _Job | None = None
        self._late: list[tuple[WeightManifest, dict[str, float]]] = []
        self._cond = threading.Condition()

    def submit(self, version: int, weights: dict[str, Any], ready: Any = None) -> _Job:
        """Take a version's snapshot (it must not change afterwards; `ready`: the CUDA event after the
        kernels that wrote it); returns its job, to be told `served`. It is encoded now, or after the
        one being encoded (replacing, and skipping, one that waited)."""
        device = self.on_device
        if device is None:
            device = ready is not None
        job = _Job(version, weights, device, ready if device else None)
        with self._cond:
            if self._running is not None:
                if self._waiting is not None:
                    self.skipped += 1
                    self.server.delta_coming(self.policy, self._waiting.version, False)
                self._waiting = job
                return job
            self._running = job
        self._start(job)
        return job

    def _start(self, job: _Job) -> None:
        name = f"astraflow-delta-{job.version}"
        threading.Thread(target=self._run, args=(job,), name=name, daemon=True).start()

    def served(self, job: _Job, blob: Any, manifest: WeightManifest | None) -> None:
        """The job's full version is held (manifest), or failed (None)."""
        try:
            job.blob, job.manifest = blob, manifest
            with self._cond:
                if manifest is not None and job in (self._running, self._waiting):
                    # announced from now on: a worker asking for its delta waits for it (bounded)
                    self.server.delta_coming(self.policy, job.version)
            if manifest is not None and not job.device:
                prev = self.server.blob(self.policy, job.version - 1)
                prev_manifest = self.server.manifest(self.policy, job.version - 1)
                if prev is not None and prev_manifest is not None:
                    job.base = (prev, prev_manifest)
        finally:
            job.served.set()  # the encode waiting for it goes on (or gives up) whatever happened

    def take_late(self) -> list[tuple[WeightManifest, dict[str, float]]]:
        """The deltas held since the last call, oldest first: their full version's manifest and the
        delta's metrics."""
        with self._cond:
            out, self._late = self._late, []
        return out

    def wait_idle(self, timeout: float) -> bool:
        """Block until no encode runs nor waits, at most `timeout` seconds; whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running is None, timeout)

    def _run(self, job: _Job) -> None:
        metrics: dict[str, float] | None = None
        try:
            metrics = self._encode(job)
        except Exception as exc:  # a delta failing costs its size on the wire, never the version
            _log.warning("%s version %d: no delta: %s", self.policy, job.version, exc)
        finally:
            job.weights, job.blob, job.base = {}, None, None
            self.server.delta_coming(self.policy, job.version, False)  # held by now, or never will be
            with self._cond:
                if metrics is not None and job.manifest is not None:
                    metrics["weights_delta_skipped"] = float(self.skipped)
                    self._late.append((job.manifest, metrics))
                self._running, self._waiting = self._waiting, None
                if self._running is None:
                    self._cond.notify_all()
                else:
                    self._start(self._running)

    def _encode(self, job: _Job) -> dict[str, float] | None:
        """Encode and hold the job's delta; its metrics (None when there is no base)."""
        if job.device:
            return self._encode_on_device(job)
        job.served.wait()
        if job.manifest is None or job.base is None:
            return None
        from astraflow.weights import delta
        from astraflow.weights.snapshot import bytes_to_state_dict

        t0 = time.monotonic()
        prev, prev_manifest = job.base
        parts = delta.host_parts(bytes_to_state_dict(prev), bytes_to_state_dict(job.blob))
        return self._hold(job, parts, prev_manifest.sha256, t0)

    def _encode_on_device(self, job: _Job) -> dict[str, float] | None:
        from astraflow.weights import delta_device
        from astraflow.weights.publisher import side_stream

        base, self._base = self._base, None
        parts, t0, seconds, base_sha = None, time.monotonic(), 0.0, ""
        if base is not None and base[0] == job.version - 1:
            base_sha = base[2]
            with side_stream(job.weights, job.ready):
                parts = delta_device.device_parts(base[1], job.weights)
            seconds = time.monotonic() - t0
        elif base is not None:
            with self._cond:
                self.skipped += 1  # the version before got no delta and was not kept as a base
        del base  # the previous snapshot's device memory goes back as soon as it was compared
        job.served.wait()
        if job.manifest is None:
            return None
        self._base = (job.version, job.weights, job.manifest.sha256)
        if parts is None:
            return None
        return self._hold(job, parts, base_sha, time.monotonic() - seconds)

    def _hold(self, job: _Job, parts: Any, base_sha: str, t0: float) -> dict[str, float]:
        """Assemble the delta and hold it; its metrics (`t0`: when the encode began)."""
        assert job.manifest is not None
        out = hold_delta(self.server, self.policy, job.version, parts, base_sha, job.manifest, t0)
        out["weights_delta_on_device"] = 1.0 if job.device else 0.0
        out["weights_delta_ready_s"] = time.monotonic() - job.submitted
        return out


def hold_delta(
    server: WeightServer,
    policy: str,
    version: int,
    parts: Any,
    base_sha: str,
    manifest: WeightManifest,
    t0: float,
) -> dict[str, float]:
    """Assemble a delta's parts under its header and hold it in `server`; its size, share of changed
    elements and encode time (since `t0`) as metrics."""
    from astraflow.weights.delta import assemble

    blob, stats = assemble(
        parts,
        base_version=version - 1,
        target_version=version,
        base_sha256=base_sha,
        target_sha256=manifest.sha256,
    )
    encode_s = time.monotonic() - t0
    server.publish(policy, version, blob, kind="delta")
    return {
        "weights_delta_changed": stats.changed / max(1, stats.elements),
        "weights_delta_bytes": stats.nbytes / max(1, manifest.nbytes),
        "weights_delta_encode_s": encode_s,
    }


def publish_delta(
    server: WeightServer, policy: str, version: int, blob: Any, manifest: WeightManifest
) -> dict[str, float]:
    """Encode and hold the delta from version - 1 (if the server holds it) now, on the host path;
    its size and time as metrics."""
    from astraflow.weights.delta import host_parts
    from astraflow.weights.snapshot import bytes_to_state_dict

    prev, prev_manifest = server.blob(policy, version - 1), server.manifest(policy, version - 1)
    if prev is None or prev_manifest is None:
        return {}
    t0 = time.monotonic()
    parts = host_parts(bytes_to_state_dict(prev), bytes_to_state_dict(blob))
    return hold_delta(server, policy, version, parts, prev_manifest.sha256, manifest, t0)

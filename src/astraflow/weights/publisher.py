"""Publish weight versions off the trainer's critical path: serialise, hash and hold on a worker thread.

The trainer copies a version's weights to the host (its only critical-path cost), hands them to
`BackgroundPublisher.start` and goes on with its next step. At most one version is in flight; the
trainer announces each finished version itself (its controller socket is not thread-safe), in order,
before it starts the next one. With deltas, each version's delta is encoded apart
(weights/delta_encoder.py): a version is served, and announced, without waiting for its delta.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from astraflow.protocol.messages import WeightManifest
from astraflow.weights.server import WeightServer


@dataclass
class Published:
    """A version that is serialised, hashed and held by the weight server, ready to be announced."""

    version: int
    manifest: WeightManifest
    metrics: dict[str, float] = field(default_factory=dict)


class BackgroundPublisher:
    """One worker thread per version; `busy` while a version waits to be announced."""

    def __init__(
        self, server: WeightServer, policy: str, *, delta: bool = False, delta_on_device: bool | None = None
    ) -> None:
        """Publish `policy`'s versions into `server`; with `delta`, also each version's delta from the
        version before, on the path `delta_on_device` names (None: the device path for a snapshot on
        a GPU; weights/delta_encoder.py)."""
        from astraflow.weights.delta_encoder import DeltaEncoder

        self.server = server
        self.policy = policy
        self.deltas = DeltaEncoder(server, policy, on_device=delta_on_device) if delta else None
        """The delta encoder (None without deltas): its metrics come later (`DeltaEncoder.take_late`)."""
        self._thread: threading.Thread | None = None
        self._result: Published | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """A version was started and not yet taken with `result`."""
        return self._thread is not None

    def ready(self) -> bool:
        """The in-flight version (if any) has finished serialising and hashing."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float) -> None:
        """Block until the in-flight version is served, at most `timeout` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)

    def prewarm(self, weights: dict[str, Any], versions: int) -> float:
        """Take page-locked host memory for `versions` blobs of `weights`' size now, at start-up, and
        give it back to torch's host allocator, which keeps it for the versions to come; returns the
        seconds it took (0.0 when `weights` are not on a GPU: blobs of host tensors are not pinned).

        Without it the first versions each pin a new blob (about 1.5 GB for a 0.6B model) while the
        trainer takes its next snapshot, and the pinning holds the snapshot's device allocations:
        on one H100 the first five versions of a run cost the trainer 0.9-2.5 s each, the later ones
        5-20 ms."""
        import torch

        from astraflow.weights.snapshot import blob_bytes

        if not torch.cuda.is_available() or not any(getattr(t, "is_cuda", False) for t in weights.values()):
            return 0.0
        nbytes = blob_bytes(weights)
        if nbytes is None:
            return 0.0
        t0 = time.monotonic()
        blocks = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(versions)]
        del blocks
        return time.monotonic() - t0

    def start(self, version: int, weights: dict[str, Any], metrics: dict[str, float]) -> None:
        """Serialise, hash and hold `weights` as `version` on a worker thread.

        `weights` must not change afterwards: host copies, or a device snapshot (the copy to the host
        then runs on its own CUDA stream, after the snapshot's kernels, beside the next step's).
        """
        if self._thread is not None:
            raise RuntimeError("a version is still in flight: take its result first")
        self._result, self._error = None, None
        ready = device_event(weights)
        job = self.deltas.submit(version, weights, ready) if self.deltas is not None else None

        def work() -> None:
            from astraflow.weights.snapshot import state_dict_to_bytes

            blob, manifest = None, None
            try:
                t0 = time.monotonic()
                if ready is None:
                    blob = state_dict_to_bytes(weights)
                else:
                    blob = _to_bytes_on_side_stream(weights, ready)
                manifest = self.server.publish(self.policy, version, blob)
                out = dict(metrics)
                if out:
                    # serialisation + digest, overlapped with the trainer's next step
                    out["trainer_publish_bg_s"] = time.monotonic() - t0
                self._result = Published(version, manifest, out)
            except BaseException as exc:  # handed to the trainer's thread by result()
                self._error = exc
            finally:
                if self.deltas is not None and job is not None:
                    self.deltas.served(job, blob, manifest)  # the delta may follow now

        self._thread = threading.Thread(target=work, name=f"astraflow-publish-{version}", daemon=True)
        self._thread.start()

    def result(self, timeout_s: float | None = None) -> Published:
        """Wait for the in-flight version and take it; re-raises the worker's error."""
        if self._thread is None:
            raise RuntimeError("no version in flight")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"publishing took longer than {timeout_s}s")
        self._thread = None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def device_event(weights: dict[str, Any]) -> Any:
    """A CUDA event after the kernels that wrote a device snapshot (None for host tensors)."""
    dev = next((t.device for t in weights.values() if getattr(t, "is_cuda", False)), None)
    if dev is None:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return event


def side_stream(weights: dict[str, Any], ready: Any) -> Any:
    """A CUDA stream that waits for `ready` (a device snapshot's event, `device_event`), entered; a
    no-op without one (host tensors)."""
    if ready is None:
        return contextlib.nullcontext()
    import torch

    dev = next(t.device for t in weights.values() if getattr(t, "is_cuda", False))
    stream = torch.cuda.Stream(dev)
    stream.wait_event(ready)
    return torch.cuda.stream(stream)


def _to_bytes_on_side_stream(weights: dict[str, Any], ready: Any) -> Any:
    import torch

    from astraflow.weights.snapshot import state_dict_to_bytes

    dev = next(t.device for t in weights.values() if t.is_cuda)
    stream = torch.cuda.Stream(dev)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        blob = state_dict_to_bytes(weights, pinned=True)
    stream.synchronize()  # the queued copies into the pinned blob are done
    return blob

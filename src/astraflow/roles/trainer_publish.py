"""How a trainer publishes and announces its versions, without waiting on a publish.

The trainer's thread only takes a snapshot of the weights (a device copy on a GPU) and hands it over.
A worker thread then checks it (the caller's `check`: finite weights) and gives it to the fast
transports (weights/transport.py: a shared slot, the broadcast hub), which pack it and return their
offers; the trainer's thread announces the version with those offers as soon as they are ready (its
controller socket is not thread-safe), at its next `poll`. At most one version is with the fast
transports; the next `publish` first waits for it (a step is far longer than packing). Its ZeroMQ blob (serialisation and sha256) is made on a worker thread
beside the next step and announced again when served (the controller records the sha256 of a known
version); a blob still queued when a newer version comes is dropped (that version already reached
the fast paths, and pull-only workers take the newer one). Without any fast offer a version is
announced once its blob is served, after the previous one, as the controller needs versions in order.
With deltas, a version's delta follows its blob (weights/delta_encoder.py) and the delta's metrics are
announced again for the same version once it is held, after the blob's announcement; the controller
adds them to the step's metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astraflow import log
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Error, VersionPublished, WeightManifest, WeightOffer
from astraflow.weights.publisher import BackgroundPublisher, device_event, side_stream

if TYPE_CHECKING:
    from astraflow.config.recipe import WeightsConfig
    from astraflow.transport.client import MemberClient

_log = log.get("trainer.publish")


class VersionAnnouncer:
    """The trainer's publishing: fast transports first, then the weight server's blob."""

    def __init__(
        self,
        client: MemberClient,
        policy: str,
        server: Any,
        fast: list[Any],
        publisher: Any = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """`fast`: trainer-side WeightTransports; `server`: the WeightServer for the ZeroMQ pull;
        `publisher`: the BackgroundPublisher that fills it (one without deltas when None); `stop`: once
        true, an announcement waiting on the controller ends in errors.Stopped."""
        self.client = client
        self.stop = stop
        self.policy = policy
        self.server = server
        self.fast = fast
        self.publisher = publisher if publisher is not None else BackgroundPublisher(server, policy)
        self._offers: dict[int, list[WeightOffer]] = {}
        self._early: set[int] = set()
        self._queued: tuple[int, dict[str, Any]] | None = None
        self._job: _FastJob | None = None
        self._served_up_to = -1
        """The newest version whose blob was announced: later metrics of it may follow."""
        self._late: list[tuple[WeightManifest, dict[str, float]]] = []

    @property
    def busy(self) -> bool:
        """A version waits for its fast offers or its blob (and its announcement)."""
        return self._job is not None or self.publisher.busy

    def wait(self, timeout: float) -> None:
        """Block until the version in flight has its offers or its blob, at most `timeout` seconds."""
        if self._job is not None and not self._job.done.is_set():
            self._job.done.wait(timeout)
        else:
            self.publisher.wait(timeout)

    def publish(
        self,
        version: int,
        weights: dict[str, Any],
        metrics: dict[str, float],
        started: float | None = None,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Publish `version` (weights that do not change afterwards); `metrics` go with its announcement;
        `started`: when the trainer began taking the weights (time.monotonic), for trainer_publish_s;
        `check` raises when the weights must not be published (run before any transport sees them;
        with fast transports on the worker thread, its error is raised by the next `poll`)."""
        t0 = time.monotonic() if started is None else started
        if self.fast:
            waited = time.monotonic()
            self._finish_job(block=True)  # the version before: announced first, in order
            self.poll()
            if metrics:
                # the trainer's own share: the snapshot and waiting for the version before
                metrics["trainer_publish_wait_s"] = time.monotonic() - waited
                metrics["trainer_publish_s"] = time.monotonic() - t0
            self._job = _FastJob(version, weights, metrics, self.fast, self.policy, check)
            return
        if check is not None:
            check(weights)
        waited = self.flush(block=True)
        if metrics:
            metrics["trainer_publish_wait_s"] = waited
            metrics["trainer_publish_s"] = waited + time.monotonic() - t0
        self.publisher.start(version, weights, metrics)

    def poll(self) -> None:
        """Announce the version whose offers are ready and the blob in flight if it is served, and
        start a queued blob; raises the worker's error (weights that failed `check`)."""
        self.flush(block=False)

    def _finish_job(self, block: bool, give_up_after_s: float = 600.0) -> None:
        """Announce the fast job's version once its offers are ready (at once if not `block`); an
        announcement waiting on the controller gives up after `give_up_after_s`."""
        job = self._job
        if job is None or (not block and not job.done.is_set()):
            return
        job.done.wait()
        self._job = None
        if job.error is not None:
            raise job.error
        metrics = {**job.metrics, "trainer_publish_fast_s": job.seconds} if job.metrics else {}
        if not job.offers:
            # no fast path took it (every slot being read, a transport failed): the blob carries it
            self.flush(block=True, give_up_after_s=give_up_after_s)
            self.publisher.start(job.version, job.weights, metrics)
            return
        self._announce(job.version, "", 0, job.offers, metrics, give_up_after_s)
        self._early.add(job.version)
        self._offers[job.version] = job.offers
        self.flush(block=False, give_up_after_s=give_up_after_s)
        if self.publisher.busy:
            self._queued = (job.version, job.weights)  # a blob older than this one is never started
        else:
            self.publisher.start(job.version, job.weights, {})

    def flush(self, block: bool, give_up_after_s: float = 600.0) -> float:
        """Announce the fast job's version once its offers are ready and the blob in flight once
        served (at once if not `block` and not ready), and, if not `block`, the metrics that came later
        (a delta's); returns the seconds spent waiting."""
        waited = 0.0
        if self._job is not None:
            t0 = time.monotonic()
            # the fast job's version first (its error, if any, raised here), under the same give-up
            self._finish_job(block, give_up_after_s)
            waited += time.monotonic() - t0
        while self.publisher.busy:
            if not block and not self.publisher.ready():
                self._announce_late(give_up_after_s)
                return waited
            t0 = time.monotonic()
            done = self.publisher.result()
            waited += time.monotonic() - t0
            early = done.version in self._early
            self._early.discard(done.version)
            offers = self._offers.pop(done.version, [])
            self._announce(
                done.version,
                done.manifest.sha256,
                done.manifest.nbytes,
                offers,
                {} if early else done.metrics,
                give_up_after_s,
            )
            self._served_up_to = max(self._served_up_to, done.version)
            if self._queued is not None:
                version, weights = self._queued
                self._queued = None
                self.publisher.start(version, weights, {})
        if not block:  # between batch requests, not on a publish's path
            self._announce_late(give_up_after_s)
        return waited

    def finish_deltas(self, timeout_s: float, give_up_after_s: float = 600.0) -> None:
        """Wait (at most `timeout_s`) for the delta being encoded and announce its metrics: the last
        version's, before the trainer leaves."""
        deltas = getattr(self.publisher, "deltas", None)
        if deltas is not None and not deltas.wait_idle(timeout_s):
            _log.warning("%s: the last delta was not encoded within %.0f s", self.policy, timeout_s)
        self._announce_late(give_up_after_s)

    def _announce_late(self, give_up_after_s: float) -> None:
        """Announce again, with the metrics that came later (a delta's), each version whose blob was
        announced; the controller adds the metrics it did not have."""
        deltas = getattr(self.publisher, "deltas", None)
        if deltas is not None:
            self._late += deltas.take_late()
        keep = []
        for manifest, metrics in self._late:
            if manifest.version > self._served_up_to:
                keep.append((manifest, metrics))  # its blob's announcement comes first
                continue
            try:
                self._announce(
                    manifest.version, manifest.sha256, manifest.nbytes, [], metrics, give_up_after_s
                )
            except AstraflowError as exc:  # metrics that came late are worth a warning, not the run
                _log.warning(
                    "%s version %d: later metrics not announced: %s", self.policy, manifest.version, exc
                )
        self._late = keep

    def prewarm(self, trainer: Any, keep_versions: int) -> None:
        """Pin the host memory of the blobs to come before the first step (BackgroundPublisher.prewarm):
        the versions the server keeps, one being written and one being sent."""
        if not getattr(trainer, "snapshots_on_device", False):
            return  # host snapshots (a CPU, several ranks, LoRA, a plugin trainer): nothing is pinned
        seconds = self.publisher.prewarm(trainer.model.state_dict(), keep_versions + 2)
        if seconds:
            _log.info("pinned host memory for %d weight blobs in %.2f s", keep_versions + 2, seconds)

    def close(self) -> None:
        """Stop the fast transports (slot files, broadcast hub)."""
        for t in self.fast:
            t.close()

    def _announce(
        self,
        version: int,
        sha256: str,
        nbytes: int,
        offers: list[WeightOffer],
        metrics: dict[str, float],
        give_up_after_s: float = 600.0,
    ) -> None:
        from astraflow.roles.member import request_retrying

        msg = VersionPublished(
            policy=self.policy,
            version=version,
            step=version,
            weights_addr=self.server.address,
            sha256=sha256,
            nbytes=nbytes,
            metrics=metrics,
            offers=offers,
        )
        # one attempt never outlasts the give-up (a stopping trainer allows its last announcement 10 s)
        timeout_s = min(30.0, give_up_after_s)
        reply = request_retrying(
            self.client, msg, timeout_s=timeout_s, give_up_after_s=give_up_after_s, stop=self.stop
        )
        if isinstance(reply, Error):
            raise AstraflowError(f"controller refused version {version}: {reply.code} {reply.message}")


class _FastJob:
    """One version's check and fast offers, made on a worker thread beside the trainer's next step."""

    def __init__(
        self,
        version: int,
        weights: dict[str, Any],
        metrics: dict[str, float],
        fast: list[Any],
        policy: str,
        check: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.version = version
        self.weights = weights
        self.metrics = metrics
        self.offers: list[WeightOffer] = []
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.done = threading.Event()
        self._fast = fast
        self._policy = policy
        self._check = check
        # a device snapshot is read on a side stream after the kernels that wrote it, so neither the
        # check nor the packing queues between the next step's kernels (nor waits for them)
        self._ready = device_event(weights)
        threading.Thread(target=self._run, name=f"astraflow-fast-publish-{version}", daemon=True).start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            with side_stream(self.weights, self._ready):
                self._work()
        except BaseException as exc:  # handed to the trainer's thread by _finish_job
            self.error = exc
        finally:
            self.seconds = time.monotonic() - t0
            self.done.set()

    def _work(self) -> None:
        if self._check is not None:
            self._check(self.weights)
        for t in self._fast:
            try:
                offer = t.publish(self.version, self.weights)
            except Exception as exc:  # a fast path failing costs speed, never the version
                _log.warning(
                    "%s version %d: %s transport failed: %s", self._policy, self.version, t.kind, exc
                )
                continue
            if offer is not None:
                self.offers.append(offer)


def trainer_transports(weights: WeightsConfig, policy: str, device: Any, host: str) -> list[Any]:
    """The fast transports the recipe allows, trainer side (the ZeroMQ weight server is apart)."""
    from astraflow.weights.transport import BroadcastTransport, SharedTransport

    allowed = weights.transports
    out: list[Any] = []
    if "ipc" in allowed:
        out.append(SharedTransport(device, policy=policy, slots=weights.shared_slots))
    if "broadcast" in allowed:
        from astraflow.weights.broadcast import BroadcastHub

        hub = BroadcastHub(
            host,
            host,
            device,
            bucket_bytes=weights.bucket_bytes,
            timeout_s=weights.broadcast_timeout_s,
        )
        out.append(BroadcastTransport(device, hub=hub))
    return out


def weight_publisher(
    cfg: WeightsConfig, host: str, policy: str, *, port: int = 0, advertise: str | None = None
) -> tuple[Any, Any]:
    """The trainer's weight server (bound on `host`, a fixed `port` or any, announced under `advertise`)
    and the publisher that fills it, as `[weights]` asks (deltas or not)."""
    from astraflow.weights.publisher import BackgroundPublisher
    from astraflow.weights.server import WeightServer

    delta = cfg.mode == "delta"
    server = WeightServer(
        host,
        chunk_bytes=cfg.chunk_bytes,
        keep_versions=cfg.keep_versions,
        keep_deltas=cfg.max_chain if delta else 0,
        port=port,
        advertise_host=advertise or host,
    )
    return server, BackgroundPublisher(server, policy, delta=delta)

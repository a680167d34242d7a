"""How a trainer publishes and announces its versions, without waiting on a publish.

Each version is first handed to the fast transports (weights/transport.py: a shared slot, the
broadcast hub), which take a device-to-device copy and return their offers; the version is announced
at once with those offers. Its ZeroMQ blob (serialisation and sha256) is made on a worker thread
beside the next step and announced again when served (the controller records the sha256 of a known
version); a blob still queued when a newer version comes is dropped (that version already reached
the fast paths, and pull-only workers take the newer one). Without any fast offer a version is
announced once its blob is served, after the previous one, as the controller needs versions in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Error, VersionPublished, WeightOffer
from astraflow.weights.publisher import BackgroundPublisher

_log = log.get("trainer.publish")


class VersionAnnouncer:
    """The trainer's publishing: fast transports first, then the weight server's blob."""

    def __init__(
        self,
        client: Any,
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

    @property
    def busy(self) -> bool:
        """A version waits for its blob (and its announcement)."""
        return self.publisher.busy

    def wait(self, timeout: float) -> None:
        """Block until the blob in flight is served, at most `timeout` seconds."""
        self.publisher.wait(timeout)

    def publish(
        self, version: int, weights: dict[str, Any], metrics: dict[str, float], started: float | None = None
    ) -> None:
        """Publish `version` (weights that do not change afterwards); `metrics` go with its announcement;
        `started`: when the trainer began taking the weights (time.monotonic), for trainer_publish_s."""
        t0 = time.monotonic() if started is None else started
        offers = self._fast_offers(version, weights)
        if offers:
            if metrics:
                metrics["trainer_publish_wait_s"] = 0.0
                metrics["trainer_publish_s"] = time.monotonic() - t0
            self._announce(version, "", 0, offers, metrics)
            self._early.add(version)
            self._offers[version] = offers
            self.poll()
            if self.publisher.busy:
                self._queued = (version, weights)  # a blob older than this one is never started
            else:
                self.publisher.start(version, weights, {})
            return
        waited = self.flush(block=True)
        if metrics:
            metrics["trainer_publish_wait_s"] = waited
            metrics["trainer_publish_s"] = waited + time.monotonic() - t0
        self.publisher.start(version, weights, metrics)

    def poll(self) -> None:
        """Announce the blob in flight if it is served, and start a queued one."""
        self.flush(block=False)

    def flush(self, block: bool, give_up_after_s: float = 600.0) -> float:
        """Announce the blob in flight once served (at once if not `block` and not ready); returns the
        seconds spent waiting."""
        waited = 0.0
        while self.publisher.busy:
            if not block and not self.publisher.ready():
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
            if self._queued is not None:
                version, weights = self._queued
                self._queued = None
                self.publisher.start(version, weights, {})
        return waited

    def close(self) -> None:
        """Stop the fast transports (slot files, broadcast hub)."""
        for t in self.fast:
            t.close()

    def _fast_offers(self, version: int, weights: dict[str, Any]) -> list[WeightOffer]:
        offers = []
        for t in self.fast:
            try:
                offer = t.publish(version, weights)
            except Exception as exc:  # a fast path failing costs speed, never the version
                _log.warning("%s version %d: %s transport failed: %s", self.policy, version, t.kind, exc)
                continue
            if offer is not None:
                offers.append(offer)
        return offers

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


def trainer_transports(recipe: Any, policy: str, device: Any, host: str) -> list[Any]:
    """The fast transports the recipe allows, trainer side (the ZeroMQ weight server is apart)."""
    from astraflow.weights.transport import BroadcastTransport, SharedTransport

    allowed = recipe.weights.transports
    out: list[Any] = []
    if "ipc" in allowed:
        out.append(SharedTransport(device, policy=policy, slots=recipe.weights.shared_slots))
    if "broadcast" in allowed:
        from astraflow.weights.broadcast import BroadcastHub

        hub = BroadcastHub(
            host,
            host,
            device,
            bucket_bytes=recipe.weights.bucket_bytes,
            timeout_s=recipe.weights.broadcast_timeout_s,
        )
        out.append(BroadcastTransport(device, hub=hub))
    return out


def weight_publisher(
    cfg: Any, host: str, policy: str, *, port: int = 0, advertise: str | None = None
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

"""How one version's weights travel from a trainer to a worker, chosen per trainer-worker pair.

A trainer publishes each version to every transport it runs and announces, with the version, the
offers they made (`WeightOffer`, fastest first) beside its weight server's address. A worker takes
the first offer it can use, in this order, and falls back to the next one (and last to the ZeroMQ
pull, which every trainer serves) when one fails:

| kind      | usable when                                  | moves the bytes by                      |
|-----------|----------------------------------------------|-----------------------------------------|
| cuda_ipc  | same host, the worker's engine on a GPU      | device-to-device copy from the trainer's buffer |
| shm       | same host                                    | a mapping of the trainer's /dev/shm slot |
| broadcast | the worker joined the trainer's group        | torch.distributed broadcast (NCCL/gloo) |
| zmq       | always                                       | the authenticated weight server (weights/client.py) |

Every path hands the engine tensors it checks (names, shapes, dtypes) and, before that, a checksum
of the bytes against the one the authenticated control plane announced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from astraflow.errors import WeightIntegrityError
from astraflow.protocol.messages import VersionInfo, WeightOffer
from astraflow.weights import packed
from astraflow.weights.shared_buffer import Received

KINDS = ("cuda_ipc", "shm", "broadcast", "zmq")
"""Every transport, fastest first."""


class WeightTransport(ABC):
    """One path weights travel. The trainer side `publish`es a version and returns its offer; the
    worker side says whether it can `use` an offer and `receive`s the version through it."""

    kind: str = ""

    def publish(self, version: int, weights: dict[str, Any]) -> WeightOffer | None:
        """Trainer side: make `version` available; the offer to announce (None: not this time)."""
        raise NotImplementedError(f"{self.kind} has no trainer side here")

    @abstractmethod
    def usable(self, offer: WeightOffer) -> bool:
        """Worker side: whether this worker can take `offer`."""

    @abstractmethod
    def receive(self, info: VersionInfo, offer: WeightOffer | None) -> Received:
        """Worker side: the version's tensors, checked against the announced digest; raises on failure."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sockets, groups, mappings."""


class SharedTransport(WeightTransport):
    """Same host: a /dev/shm slot (CPU) or a CUDA IPC buffer, double-buffered (weights/shared_buffer.py)."""

    def __init__(self, device: torch.device, *, policy: str = "", slots: int = 2) -> None:
        """`device`: where the trainer's packed buffer lives (trainer side) or the engine runs (worker side)."""
        from astraflow.weights.shared_buffer import SharedExporter, SharedImporter, host_id

        self.device = device
        self.kind = "cuda_ipc" if device.type == "cuda" else "shm"
        self.host = host_id()
        self._exporter = SharedExporter(policy, device, slots) if policy else None
        self._importer = SharedImporter(device)

    def publish(self, version: int, weights: dict[str, Any]) -> WeightOffer | None:
        """Pack into a free slot (never waits); None when both slots are still being read."""
        assert self._exporter is not None, "a worker-side transport does not publish"
        out = self._exporter.publish(version, weights)
        if out is None:
            return None
        return WeightOffer(kind=out.kind, host=self.host, path=out.path, ipc=out.ipc, digest=out.digest)

    def usable(self, offer: WeightOffer) -> bool:
        """Same host, and CUDA IPC only for an engine on a GPU."""
        if offer.host != self.host:
            return False
        return offer.kind == "shm" or (offer.kind == "cuda_ipc" and self.device.type == "cuda")

    def receive(self, info: VersionInfo, offer: WeightOffer | None) -> Received:
        """Map and check the slot; the lock is held until `Received.release`."""
        assert offer is not None
        return self._importer.receive(offer.kind, offer.path, offer.ipc, info.version, offer.digest)

    def close(self) -> None:
        """Remove this trainer's slot files."""
        if self._exporter is not None:
            self._exporter.close()


class BroadcastTransport(WeightTransport):
    """Other hosts: the trainer's broadcast groups (weights/broadcast.py)."""

    kind = "broadcast"

    def __init__(
        self,
        device: torch.device,
        *,
        member_id: str = "",
        hub: Any = None,
        timeout_s: float = 30.0,
        wait_s: float = 10.0,
    ) -> None:
        """Trainer side with a `hub` (BroadcastHub); worker side with the worker's `member_id`."""
        self.device = device
        self.member_id = member_id
        self.hub = hub
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        """How long a worker waits for a version's broadcast once it is announced, before falling back."""
        self._members: dict[tuple[str, str], Any] = {}

    def publish(self, version: int, weights: dict[str, Any]) -> WeightOffer | None:
        """Queue the version for the hub's thread; the offer names the store and the group's secret."""
        digest = self.hub.publish(version, weights)
        return WeightOffer(kind="broadcast", address=self.hub.address, token=self.hub.token, digest=digest)

    def usable(self, offer: WeightOffer) -> bool:
        """A broadcast offer with a digest; asking joins the offer's group (joining is how a worker
        finds out whether it can reach the trainer), so the next versions come this way."""
        if offer.kind != "broadcast" or not self.member_id:
            return False
        self.member(offer)
        return bool(offer.digest)

    def member(self, offer: WeightOffer) -> Any:
        """This worker's membership of the offer's group, joined on first use."""
        from astraflow.weights.broadcast import BroadcastMember

        key = (offer.address, offer.token)
        m = self._members.get(key)
        if m is None or not m.alive:
            for old in self._members.values():
                old.close()  # a new trainer (address or secret changed): leave the old groups
            self._members = {}
            m = self._members[key] = BroadcastMember(
                offer.address, offer.token, self.member_id, self.device, timeout_s=self.timeout_s
            )
        return m

    def receive(self, info: VersionInfo, offer: WeightOffer | None) -> Received:
        """Wait (up to wait_s) for the version's broadcast and check it."""
        assert offer is not None
        m = self.member(offer)
        got = m.wait_for(info.version, self.wait_s)
        if got is None or got.version != info.version or m.layout is None:
            raise WeightIntegrityError(
                f"version {info.version} did not arrive by broadcast within {self.wait_s:g}s", hint=""
            )
        if got.digest != offer.digest or packed.digest(got.buf) != offer.digest:
            raise WeightIntegrityError(f"broadcast version {info.version}: digest mismatch", hint="")
        return Received(info.version, packed.views(got.buf, m.layout), got.buf.numel())

    def close(self) -> None:
        """Leave every group (worker side) or stop the hub (trainer side)."""
        for m in self._members.values():
            m.close()
        if self.hub is not None:
            self.hub.close()


class ZmqTransport(WeightTransport):
    """The authenticated pull from the trainer's weight server: always usable, the fallback."""

    kind = "zmq"

    def __init__(self, fetch: Callable[[VersionInfo], Received] | None = None) -> None:
        """`fetch`: how a worker pulls (weights/fetch.py: delta chains, relays); None pulls the full
        version from the trainer's weight server into a reused buffer."""
        self._fetch = fetch
        self._buffers: Any = None

    def usable(self, offer: WeightOffer) -> bool:
        """The pull needs no offer."""
        return True

    def receive(self, info: VersionInfo, offer: WeightOffer | None) -> Received:
        """Pull, verify the sha256 and parse the safetensors blob in place."""
        if self._fetch is not None:
            return self._fetch(info)
        from astraflow.weights.client import RecvBuffers, fetch_weights
        from astraflow.weights.snapshot import bytes_to_state_dict

        if self._buffers is None:
            self._buffers = RecvBuffers()
        into = self._buffers
        blob = fetch_weights(
            info.weights_addr, info.policy, info.version, expect_sha256=info.sha256, into=into
        )
        return Received(
            info.version, bytes_to_state_dict(blob), len(blob), _on_release=lambda: into.give(blob)
        )


def choose(
    info: VersionInfo, transports: dict[str, WeightTransport], allowed: list[str]
) -> list[tuple[WeightTransport, WeightOffer | None]]:
    """The paths to try for `info`, fastest first, ending with the ZeroMQ pull when allowed."""
    out: list[tuple[WeightTransport, WeightOffer | None]] = []
    for kind in KINDS[:-1]:
        t = transports.get("shm" if kind == "cuda_ipc" else kind)
        if t is None or _family(kind) not in allowed:
            continue
        if kind == "broadcast" and out:
            continue  # a same-host path is usable: never join the broadcast (joining costs the trainer)
        out += [(t, o) for o in info.offers if o.kind == kind and t.usable(o)]
    # a version announced before its blob is served (sha256 still "") is pulled once it is announced again
    if "zmq" in transports and "zmq" in allowed and info.weights_addr and (info.sha256 or not info.offers):
        out.append((transports["zmq"], None))
    return out


def _family(kind: str) -> str:
    """The recipe's name of a kind: cuda_ipc and shm are both `ipc`."""
    return "ipc" if kind in ("cuda_ipc", "shm") else kind

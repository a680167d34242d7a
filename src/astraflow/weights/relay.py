"""Relays: workers serve the versions they pulled to peers of their region, so a region costs the
trainer one upload per version.

The controller keeps a `RelayDirectory` from heartbeats (each worker's relay address, region and loaded
versions) and, in every `VersionInfo` it sends a worker, lists the relays of that worker's region that
hold the version. When none holds it yet, one worker of the region (the first by id: the seed) pulls
from the trainer and the others are pointed at the seed, whose weight server answers `not_yet` until
it holds the version; a worker waits for that at most `[weights] relay_wait_s` and falls back to the
trainer whenever a relay fails (weights/fetch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_RELAYS = 3
"""Relays named per version: a few to fall back on, not the whole region."""


@dataclass
class _Member:
    addr: str
    region: str
    seen: float
    loaded: dict[str, int] = field(default_factory=dict)


class RelayDirectory:
    """Which relay of which region holds which version, as the heartbeats said."""

    def __init__(self, stale_s: float) -> None:
        """Members not heard from for `stale_s` are not named as relays."""
        self.stale_s = stale_s
        self._members: dict[str, _Member] = {}

    def update(self, member_id: str, region: str, addr: str, loaded: dict[str, int], now: float) -> None:
        """A heartbeat: the member's relay address ("" = none) and what it holds."""
        if not addr:
            self._members.pop(member_id, None)
            return
        self._members[member_id] = _Member(addr, region, now, dict(loaded))

    def forget(self, member_id: str) -> None:
        """The member left or died."""
        self._members.pop(member_id, None)

    def relays_for(self, member_id: str, region: str, policy: str, version: int, now: float) -> list[str]:
        """Relay addresses `member_id` should pull `policy@version` from first ([] = the trainer)."""
        peers = {
            mid: m
            for mid, m in self._members.items()
            if m.region == region and now - m.seen <= self.stale_s and policy in m.loaded
        }
        holders = sorted(mid for mid, m in peers.items() if mid != member_id and m.loaded[policy] == version)
        if holders:
            # spread the region's pullers over the holders
            start = sum(member_id.encode()) % len(holders)
            ring = holders[start:] + holders[:start]
            return [peers[mid].addr for mid in ring[:MAX_RELAYS]]
        if member_id not in peers or peers[member_id].loaded.get(policy, -1) >= version:
            return []
        seed = min(mid for mid, m in peers.items() if m.loaded[policy] < version)
        return [] if seed == member_id else [peers[seed].addr]


def relay_server(cfg: Any, host: str) -> Any:
    """A worker's relay weight server ([weights] settings), authenticated like a trainer's."""
    from astraflow.weights.server import WeightServer

    return WeightServer(
        host,
        chunk_bytes=cfg.chunk_bytes,
        keep_versions=2,
        keep_deltas=cfg.max_chain if cfg.mode == "delta" else 0,
        relay=True,
    )

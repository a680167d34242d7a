"""How many pullers of one key a weight server serves at once.

Each connection that asks may get up to SNDHWM chunks queued for it (each a copy under CURVE), so
many connections from one key that ask and never read would hold that many chunks each in the
trainer. The server answers at most PER_KEY connections (routing ids) of one CURVE key at a time; a
connection counts until it has asked nothing for IDLE_S. The others get no answer (nothing is queued
for them) and a real puller retries. Plain (no CURVE) servers are not limited: they have no key."""

from __future__ import annotations

PER_KEY = 16
"""Connections of one key served at once: a RaaS pulls one version per policy at a time, each over up
to `[weights] pull_connections` (at most 8; by default 4) connections, and a finished pull's
connections count for IDLE_S more."""
IDLE_S = 2.0
"""A connection that asked nothing for this long no longer counts against its key."""


class PullLimit:
    """Per key, the routing ids served lately; memory is at most PER_KEY ids per key seen in IDLE_S."""

    def __init__(self, per_key: int = PER_KEY, idle_s: float = IDLE_S) -> None:
        self.per_key = per_key
        self.idle_s = idle_s
        self._peers: dict[bytes, dict[bytes, float]] = {}
        self._pruned = 0.0

    def admit(self, key: bytes, peer: bytes, now: float) -> bool:
        """Whether to answer this request of `peer` (a routing id) under `key` (b'': no CURVE)."""
        if not key:
            return True
        if now - self._pruned > self.idle_s:
            self._prune(now)
        peers = self._peers.setdefault(key, {})
        if peer not in peers:
            for p, seen in list(peers.items()):
                if now - seen > self.idle_s:
                    del peers[p]
            if len(peers) >= self.per_key:
                return False
        peers[peer] = now
        return True

    def _prune(self, now: float) -> None:
        self._pruned = now
        for key in list(self._peers):
            live = {p: t for p, t in self._peers[key].items() if now - t <= self.idle_s}
            if live:
                self._peers[key] = live
            else:
                del self._peers[key]

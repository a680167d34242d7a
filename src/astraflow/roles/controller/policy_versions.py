"""The policies' newest versions as members are told of them, and whether every step budget is met.

Both are read-through caches over the store that change only when a version is recorded (`changed`):
heartbeats of thousands of members read them. The faster weight paths a trainer offered for its newest
version (`offer`) and, with `[weights] relays`, which members of a region hold which versions are kept
here too, in memory only: after a restart workers pull the current version from the weight server until
the next one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from astraflow.protocol import messages as m
from astraflow.state.store import Store

if TYPE_CHECKING:
    from astraflow.weights.relay import RelayDirectory


class PolicyVersions:
    """The newest version of each policy, per member with relays, and the step budgets."""

    def __init__(
        self, store: Store, budgets: dict[str, int], *, relays: bool, member_timeout_s: float
    ) -> None:
        self.store = store
        self.budgets = budgets
        """Trainable policy -> its step budget."""
        self.relays = relays
        """`[weights] relays`: each version names the relays of the member's region that hold it."""
        self.member_timeout_s = member_timeout_s
        self.offers: dict[str, tuple[int, list[m.WeightOffer]]] = {}
        """Policy -> (version, the faster weight paths its trainer offered for it)."""
        self.relay_dir: RelayDirectory | None = None
        """Which members of a region hold which versions (made at first use)."""
        self._latest: list[m.VersionInfo] | None = None
        self._budgets_met: bool | None = None
        self.generation = 0
        """Counts `changed` calls (a version recorded or announced again; an offer always comes with
        one): a member told the versions at one generation needs telling again only at another
        (roles/controller/beats.py)."""

    def latest(self) -> list[m.VersionInfo]:
        """The newest version of each policy that has one."""
        if self._latest is None:
            self._latest = [
                m.VersionInfo(
                    policy=v["policy"],
                    version=v["version"],
                    weights_addr=v["weights_addr"] or "",
                    sha256=v["sha256"] or "",
                    offers=self._offers_for(v["policy"], v["version"]),
                )
                for v in self.store.latest_versions()
            ]
        return list(self._latest)

    def budgets_met(self) -> bool:
        """True once every trainable policy reached its step budget."""
        if self._budgets_met is None:
            steps = {p["name"]: int(p["step"]) for p in self.store.policies()}
            self._budgets_met = all(steps.get(name, 0) >= n for name, n in self.budgets.items())
        return self._budgets_met

    def changed(self) -> None:
        """Forget the cached versions and budgets (a version was recorded)."""
        self._latest = None
        self._budgets_met = None
        self.generation += 1

    def offer(self, msg: m.VersionPublished) -> None:
        """Keep the faster paths a trainer offers for a version no older than the one kept."""
        if msg.offers and msg.version >= self.offers.get(msg.policy, (-1, []))[0]:
            self.offers[msg.policy] = (msg.version, list(msg.offers))

    def for_member(self, member: dict[str, Any], beat: m.Heartbeat | None = None) -> list[m.VersionInfo]:
        """The newest versions as `member` should pull them: with `[weights] relays`, each names the
        relays of the member's region that hold it (a heartbeat first updates the directory)."""
        infos = self.latest()
        if not self.relays:
            return infos
        from astraflow.weights.relay import RelayDirectory

        now = time.time()
        if self.relay_dir is None:
            self.relay_dir = RelayDirectory(self.member_timeout_s)
        relay_dir = self.relay_dir
        mid, region = str(member["id"]), str(member.get("region") or "")
        if beat is not None:
            relay_dir.update(mid, region, beat.relay_addr, dict(beat.loaded), now)
        # the cached infos are shared by every member: each gets copies naming its own region's relays
        return [
            msgspec.structs.replace(
                info, relays=relay_dir.relays_for(mid, region, info.policy, info.version, now)
            )
            if info.weights_addr
            else info
            for info in infos
        ]

    def _offers_for(self, policy: str, version: int) -> list[m.WeightOffer]:
        held = self.offers.get(policy)
        return held[1] if held is not None and held[0] == version else []

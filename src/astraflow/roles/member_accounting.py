"""Per-member accounting: each worker's recent outcomes, its quarantine, its share of the open tasks,
and the de-duplicated error reports of its heartbeats (their rate limit is roles/controller/beats.py).

A failed attempt (an `error` result, an invalid result, a lapsed lease) is first charged to the
member. It counts against the task (its max_attempts, and so the run's max_failed_tasks) only when
no other live, unquarantined worker of the same role does markedly better (a failure share at least
GAP lower over its last WINDOW outcomes; a peer with no outcome yet counts as doing better): a key
answering `error` for every lease burns no task while a healthy worker is connected, and a lone
worker's failures (or a workflow that fails everywhere) count as before. A member with at least
controller.quarantine_after failures among its last WINDOW outcomes, while a peer that succeeded
does GAP better, is quarantined for controller.quarantine_s: it is leased nothing while a healthy
peer is alive (alone, it is leased again and its failures count). The state lives in the store
(members.failures / invalid / expiries / quarantined), so `status` shows it and a restart keeps it.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from typing import TYPE_CHECKING, Any

from astraflow import log
from astraflow.state import member_health
from astraflow.state.member_health import Kind

if TYPE_CHECKING:
    from astraflow.config.recipe import Recipe
    from astraflow.state.store import Store

_log = log.get("member_accounting")

WINDOW = 32
"""Outcomes remembered per member."""
GAP = 0.5
"""How much lower a peer's failure share must be for a member's failures to be its own."""


class MemberAccounting:
    """The controller's per-member ledger of outcomes; memory is one entry per member id whose row
    the store keeps (`forget` when the row is pruned, controller.forget_after_s after its death)."""

    def __init__(self, store: Store, recipe: Recipe) -> None:
        self.store = store
        self.cfg = recipe.controller
        self.recent: dict[str, deque[bool]] = {}
        """Member -> its last WINDOW outcomes (True: failed)."""
        self.last_error: dict[str, int] = {}
        """Member -> checksum of the last error it reported (repeats are not written again)."""

    def forget(self, member_id: str) -> None:
        """Drop what memory holds of a member (pruned from the store)."""
        self.recent.pop(member_id, None)
        self.last_error.pop(member_id, None)

    def share(self, member_id: str) -> float:
        """The member's failure share over its recent outcomes (0 with none)."""
        d = self.recent.get(member_id)
        return sum(d) / len(d) if d else 0.0

    def succeeded(self, member_id: str) -> None:
        """Record an accepted result."""
        d = self.recent.get(member_id)
        if d is None:  # not `setdefault`: that builds a deque for every result
            d = self.recent[member_id] = deque(maxlen=WINDOW)
        d.append(False)

    def failed(self, member: dict[str, Any], kind: Kind, now: float | None = None) -> bool:
        """Record a failed attempt; True when it counts against the task (see the module's rule)."""
        mid = str(member["id"])
        self.recent.setdefault(mid, deque(maxlen=WINDOW)).append(True)
        member_health.count(self.store, mid, kind)
        mine = self.share(mid)
        better = [
            p
            for p in member_health.alive_workers(self.store, str(member["role"]))
            if p["id"] != mid and not p["quarantined"] and self.share(p["id"]) <= mine - GAP
        ]
        if not better:
            return True
        fails = sum(self.recent[mid])
        proven = any(p["id"] in self.recent and not all(self.recent[p["id"]]) for p in better)
        if fails >= self.cfg.quarantine_after and proven and not member.get("quarantined"):
            t = time.time() if now is None else now
            reason = (
                f"{fails} of its last {len(self.recent[mid])} attempts failed; healthy peers: "
                + ", ".join(p["id"] for p in better[:3])
            )
            with self.store.write():
                member_health.quarantine(self.store, mid, reason, t + self.cfg.quarantine_s)
                self.store.add_event("member_quarantined", f"{mid}: {reason}")
            _log.warning("member %s quarantined for %.0fs: %s", mid, self.cfg.quarantine_s, reason)
        return False

    def lapsed(self, now: float) -> list[str]:
        """Charge the leases about to lapse now to their owners (call before the ledger expires them);
        returns the owners whose lapses are their own (their leases go back uncounted)."""
        spared: list[str] = []
        for owner, n in member_health.expiring_owners(self.store, now).items():
            member = self.store.member(owner)
            if member is None:
                continue
            counts = True
            for _ in range(min(n, WINDOW)):
                counts = self.failed(member, "expiries", now)
            if n > WINDOW:
                member_health.count(self.store, owner, "expiries", n - WINDOW)
            if not counts:
                spared.append(owner)
        return spared

    def may_lease(self, member: dict[str, Any], now: float | None = None) -> bool:
        """False while the member is quarantined and a healthy peer of its role is alive."""
        if not member.get("quarantined"):
            return True
        t = time.time() if now is None else now
        mid = str(member["id"])
        if t >= float(member.get("quarantined_until") or 0.0):
            with self.store.write():
                member_health.release(self.store, mid)
                self.store.add_event("member_released", f"{mid}: quarantine over")
            self.recent.pop(mid, None)  # on probation: a fresh record
            return True
        peers = member_health.alive_workers(self.store, str(member["role"]))
        return not any(p["id"] != mid and not p["quarantined"] for p in peers)

    def quota(self, member: dict[str, Any], n: int) -> int:
        """Cap a lease request so one worker holds at most max_member_share of the open tasks while
        another healthy worker of its role is alive (one key cannot take the whole admission window)."""
        mid = str(member["id"])
        if not member_health.healthy_peer(self.store, str(member["role"]), mid):
            return n
        held, open_ = member_health.held_and_open(self.store, mid)
        cap = max(1, math.ceil(self.cfg.max_member_share * open_))
        return max(0, min(n, cap - held))

    def new_error(self, member_id: str, error: str) -> bool:
        """True when this error differs from the member's last reported one (only those are recorded)."""
        key = zlib.crc32(error.encode("utf-8", "replace"))
        if self.last_error.get(member_id) == key:
            return False
        self.last_error[member_id] = key
        return True

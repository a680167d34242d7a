"""The members' hot fields in the controller's memory: when each was last heard from, what it has
loaded, how many slots it reports.

A heartbeat (or a task request) of a live member only updates this table: O(1), no SQLite write. The
table is written to state.db every `FLUSH_S` in one transaction (readers such as `astraflow status`
see last_seen at most that old) and before anything that reads those fields from the store. Liveness
is decided here: members are kept in the order they were last heard from, so the liveness check
looks only at the silent ones at the front, never at every member. None of this needs durability: a
restarted controller gives every member a fresh timer (Controller.start).

Member rows themselves (role, status, policies, accounting) stay in state.db; `row` keeps a copy of
each live member's row for the per-message identity check and the handlers, so a message does not
read its member's row from state.db. The copy is dropped whenever a statement changes that row (the
store tells, `Store.on_member_change`: join, leave, death, a failure counted, a quarantine) and when
a write transaction rolls back, and read again at the member's next message.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from astraflow.state.store import Store

FLUSH_S = 1.0
"""Seconds between writes of the hot fields to state.db."""


class MemberTable:
    """Live members' last_seen / loaded / slots, in the order they were last heard from."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seen: OrderedDict[str, float] = OrderedDict()
        """Alive member id -> last heard from (time.time()), oldest first."""
        self.rows: dict[str, dict[str, Any]] = {}
        """Member id -> its row as last read or written by the controller (hot fields kept current)."""
        self.pending: dict[str, tuple[float, dict[str, int] | None, int | None]] = {}
        """Touches not yet written: member -> (last_seen, loaded or None, slots or None)."""
        self.last_flush = 0.0
        store.on_member_change.append(self.forget)
        store.on_rollback.append(self.forget)

    def load(self, now: float) -> None:
        """Every alive member of state.db, each with a fresh timer (a restarted controller's start)."""
        self.seen.clear()
        self.rows.clear()
        for mem in self.store.members("alive"):
            self.seen[str(mem["id"])] = now

    def row(self, member_id: str) -> dict[str, Any] | None:
        """The member's row (from memory when the controller already read it), or None."""
        row = self.rows.get(member_id)
        if row is None:
            row = self.store.member(member_id)
            if row is None:
                return None
            held = self.pending.get(member_id)
            if held is not None:  # what the store does not hold yet
                _apply(row, held)
            self.rows[member_id] = row
        return row

    def forget(self, member_id: str | None = None) -> None:
        """Drop the cached row of one member (or of all): the controller changed it in the store."""
        if member_id is None:
            self.rows.clear()
        else:
            self.rows.pop(member_id, None)

    def joined(self, member_id: str, now: float) -> None:
        """A member (re)joined: alive from now; its row is read afresh."""
        self.pending.pop(member_id, None)
        self.rows.pop(member_id, None)
        self.seen[member_id] = now
        self.seen.move_to_end(member_id)

    def gone(self, member_id: str) -> None:
        """A member died or left: no longer timed; what it last reported is still written."""
        self.seen.pop(member_id, None)
        self.rows.pop(member_id, None)

    def touch(
        self, member_id: str, now: float, loaded: dict[str, int] | None = None, slots: int | None = None
    ) -> None:
        """The member was heard from (with what it has loaded and its slots, when it says)."""
        if member_id not in self.seen:
            return  # not alive: nothing to renew
        self.seen[member_id] = now
        self.seen.move_to_end(member_id)
        row = self.rows.get(member_id)
        if row is not None:
            # what the store (or the pending write) already says needs no write again
            if loaded is not None and loaded == row.get("loaded"):
                loaded = None
            if slots is not None and slots == row.get("slots"):
                slots = None
        old = self.pending.get(member_id)
        if old is not None:
            loaded = loaded if loaded is not None else old[1]
            slots = slots if slots is not None else old[2]
        self.pending[member_id] = (now, loaded, slots)
        if row is not None:
            _apply(row, (now, loaded, slots))

    def silent(self, cutoff: float) -> list[tuple[str, float]]:
        """(id, last heard from) of alive members not heard from since `cutoff`: only the front of the order."""
        out: list[tuple[str, float]] = []
        for mid, t in self.seen.items():
            if t >= cutoff:
                break
            out.append((mid, t))
        return out

    def flush(self, now: float | None = None) -> int:
        """Write the pending touches in one transaction (when `now` is given, only once FLUSH_S passed);
        returns how many members were written."""
        if now is not None and now - self.last_flush < FLUSH_S:
            return 0
        if now is not None:
            self.last_flush = now
        if not self.pending:
            return 0
        pending, self.pending = self.pending, {}
        self.store.touch_members(pending)
        return len(pending)


def _apply(row: dict[str, Any], touch: tuple[float, dict[str, int] | None, int | None]) -> None:
    t, loaded, slots = touch
    row["last_seen"] = t
    if loaded is not None:
        row["loaded"] = dict(loaded)
    if slots is not None:
        row["slots"] = slots

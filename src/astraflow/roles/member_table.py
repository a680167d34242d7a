"""The members' hot fields in the controller's memory: when each was last heard from, what it has
loaded, how many slots it reports.

A heartbeat (or a task request) of a live member only updates this table: O(1), no SQLite write. What
changed of the loaded versions and slots is written to state.db every `FLUSH_S` in one transaction;
last_seen alone (all an idle member's beat changes) every `SEEN_FLUSH_S`, so thousands of idle members
cost one write of their rows every few seconds, not every second (readers of state.db such as
`astraflow status --run-dir` see last_seen at most that old); and all of it before anything that
reads those fields from the store (a Hello's identity check, a StatusRequest, the death of a silent
member). Liveness is decided here: a member is dead after member_timeout_s times its timeout scale
(1 for a member that beats at the recipe's interval, more for an idle one that said it beats less
often: roles/controller/beat_pace.py). Members of one scale are a lane, kept in the order they were
last heard from, so the liveness check looks only at the silent ones at the front of each lane,
never at every member. None of this needs durability: a restarted controller gives every member a
fresh timer (Controller.start) in the widest lane (it does not know how often each beats) until
its first heartbeat says.

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
"""Seconds between writes of the changed loaded versions and slots to state.db."""
SEEN_FLUSH_S = 5.0
"""Seconds between writes of last_seen of the members nothing else changed of."""


class MemberTable:
    """Live members' last_seen / loaded / slots, in the order they were last heard from."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seen: dict[str, float] = {}
        """Alive member id -> last heard from (time.time())."""
        self.lanes: dict[float, OrderedDict[str, float]] = {1.0: OrderedDict()}
        """Timeout scale -> its alive members and when each was last heard from, oldest first."""
        self.scale: dict[str, float] = {}
        """Member -> its timeout scale, for the members whose scale is not 1."""
        self.rows: dict[str, dict[str, Any]] = {}
        """Member id -> its row as last read or written by the controller (hot fields kept current)."""
        self.pending: dict[str, tuple[float, dict[str, int] | None, int | None]] = {}
        """Touches that changed loaded or slots, not yet written: member -> (last_seen, loaded or None,
        slots or None)."""
        self.heard: set[str] = set()
        """Members heard from since last_seen was last written, whose touches changed nothing else."""
        self.last_flush = 0.0
        self.last_seen_flush = 0.0
        store.on_member_change.append(self.forget)
        store.on_rollback.append(self.forget)

    def load(self, now: float, scale: float = 1.0) -> None:
        """Every alive member of state.db, each with a fresh timer in the lane of `scale` (a restarted
        controller's start: the widest, until each member's first beat says how often it beats)."""
        self.seen.clear()
        self.rows.clear()
        self.heard.clear()
        self.lanes = {1.0: OrderedDict()}
        self.scale.clear()
        for mem in self.store.members("alive"):
            mid = str(mem["id"])
            self.seen[mid] = now
            self.lanes.setdefault(scale, OrderedDict())[mid] = now
            if scale != 1.0:
                self.scale[mid] = scale

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
            elif member_id in self.heard:
                row["last_seen"] = self.seen.get(member_id, row["last_seen"])
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
        self.heard.discard(member_id)
        self.rows.pop(member_id, None)
        self._unlane(member_id)
        self.seen[member_id] = now
        self.lanes[1.0][member_id] = now

    def gone(self, member_id: str) -> None:
        """A member died or left: no longer timed; what it last reported is still written."""
        heard = self.seen.pop(member_id, None)
        self._unlane(member_id)
        if member_id in self.heard:
            self.heard.discard(member_id)
            if heard is not None and member_id not in self.pending:
                self.pending[member_id] = (heard, None, None)
        self.rows.pop(member_id, None)

    def touch(
        self, member_id: str, now: float, loaded: dict[str, int] | None = None, slots: int | None = None
    ) -> None:
        """The member was heard from (with what it has loaded and its slots, when it says)."""
        seen = self.seen
        if member_id not in seen:
            return  # not alive: nothing to renew
        seen[member_id] = now
        lane = self.lanes[self.scale.get(member_id, 1.0)]
        lane[member_id] = now
        lane.move_to_end(member_id)
        row = self.rows.get(member_id)
        if row is not None:
            # what the store (or the pending write) already says needs no write again
            if loaded is not None and loaded == row.get("loaded"):
                loaded = None
            if slots is not None and slots == row.get("slots"):
                slots = None
            row["last_seen"] = now
            if loaded is None and slots is None and member_id not in self.pending:
                self.heard.add(member_id)  # only last_seen changed: written every SEEN_FLUSH_S
                return
        old = self.pending.get(member_id)
        if old is not None:
            loaded = loaded if loaded is not None else old[1]
            slots = slots if slots is not None else old[2]
        self.pending[member_id] = (now, loaded, slots)
        if row is not None:
            _apply(row, (now, loaded, slots))

    def pace(self, member_id: str, scale: float) -> None:
        """The member's timeout scale from now on (beat_pace.timeout_scale of its last beat); call it
        right after `touch`, so the member joins its new lane's end as the newest heard from."""
        old = self.scale.get(member_id, 1.0)
        if scale == old or member_id not in self.seen:
            return
        self.lanes[old].pop(member_id, None)
        self.lanes.setdefault(scale, OrderedDict())[member_id] = self.seen[member_id]
        if scale == 1.0:
            del self.scale[member_id]
        else:
            self.scale[member_id] = scale

    def timeout(self, member_id: str, member_timeout_s: float) -> float:
        """How long this member may be silent before it is dead."""
        return member_timeout_s * self.scale.get(member_id, 1.0)

    def silent(self, now: float, member_timeout_s: float) -> list[tuple[str, float]]:
        """(id, last heard from) of alive members silent past their timeout (member_timeout_s times
        their scale): only the front of each lane."""
        out: list[tuple[str, float]] = []
        for scale, lane in list(self.lanes.items()):
            if not lane and scale != 1.0:
                del self.lanes[scale]
                continue
            cutoff = now - member_timeout_s * scale
            for mid, t in lane.items():
                if t >= cutoff:
                    break
                out.append((mid, t))
        return out

    def _unlane(self, member_id: str) -> None:
        self.lanes[self.scale.pop(member_id, 1.0)].pop(member_id, None)

    def flush_member(self, member_id: str) -> None:
        """Write what is pending of one member (a Hello's identity check reads its last_seen): a join
        costs one row, not a write of every member heard from."""
        entry = self.pending.pop(member_id, None)
        if entry is None and member_id in self.heard and member_id in self.seen:
            entry = (self.seen[member_id], None, None)
        self.heard.discard(member_id)
        if entry is not None:
            self.store.touch_members({member_id: entry})

    def flush(self, now: float | None = None) -> int:
        """Write the pending touches in one transaction, with last_seen of the members only heard from
        when SEEN_FLUSH_S passed (when `now` is given; without it, everything at once); returns how
        many members were written."""
        if now is not None and now - self.last_flush < FLUSH_S:
            return 0
        if now is not None:
            self.last_flush = now
        pending, self.pending = self.pending, {}
        if now is None or now - self.last_seen_flush >= SEEN_FLUSH_S:
            if now is not None:
                self.last_seen_flush = now
            seen = self.seen
            for mid in self.heard:
                if mid not in pending and mid in seen:
                    pending[mid] = (seen[mid], None, None)
            self.heard = set()
        if not pending:
            return 0
        self.store.touch_members(pending)
        return len(pending)


def _apply(row: dict[str, Any], touch: tuple[float, dict[str, int] | None, int | None]) -> None:
    t, loaded, slots = touch
    row["last_seen"] = t
    if loaded is not None:
        row["loaded"] = dict(loaded)
    if slots is not None:
        row["slots"] = slots

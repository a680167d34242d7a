"""The store's questions about members' health: per-member failure counts and quarantine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from astraflow.state import open_shapes

if TYPE_CHECKING:
    from astraflow.state.store import Store

Kind = Literal["failures", "invalid", "expiries"]
"""What went wrong: a failed attempt, an invalid result, a lease that lapsed."""


def count(store: Store, member_id: str, kind: Kind, n: int = 1) -> None:
    """Add n to one of a member's counters."""
    column = {"failures": "failures", "invalid": "invalid", "expiries": "expiries"}[kind]
    with store.write() as c:
        c.execute(f"UPDATE members SET {column} = {column} + ? WHERE id = ?", (n, member_id))
    store.member_changed(member_id)


def expiring_owners(store: Store, now: float) -> dict[str, int]:
    """Owner -> how many of its leases are past their expiry now."""
    rows = store.query(
        "SELECT owner, COUNT(*) AS n FROM tasks WHERE status = 'leased' AND lease_expiry < ? GROUP BY owner",
        (now,),
    )
    return {str(r["owner"]): int(r["n"]) for r in rows if r["owner"]}


def quarantine(store: Store, member_id: str, reason: str, until: float) -> None:
    """Quarantine a member until then (reason: why, shown in status)."""
    with store.write() as c:
        c.execute(
            "UPDATE members SET quarantined = ?, quarantined_until = ? WHERE id = ?",
            (reason, until, member_id),
        )
    store.member_changed(member_id)


def release(store: Store, member_id: str) -> None:
    """End a member's quarantine."""
    quarantine(store, member_id, "", 0.0)


def alive_workers(store: Store, role: str) -> list[dict[str, Any]]:
    """Id, quarantine and deadline of every live member of a role."""
    rows = store.query(
        "SELECT id, quarantined, quarantined_until FROM members WHERE status = 'alive' AND role = ?", (role,)
    )
    return [dict(r) for r in rows]


def healthy_peer(store: Store, role: str, member_id: str) -> bool:
    """Whether a live member of the role other than `member_id` is out of quarantine (an index
    lookup of at most two rows, not a read of every member)."""
    rows = store.query(
        "SELECT id FROM members WHERE status = 'alive' AND role = ? AND quarantined = '' LIMIT 2", (role,)
    )
    return any(r["id"] != member_id for r in rows)


def held_and_open(store: Store, member_id: str) -> tuple[int, int]:
    """(leases the member holds, tasks queued or leased in all). Inside a lease call the open tasks
    are the kept counts per shape (state/open_shapes.py, read once a call) and the held ones a
    search of the (owner, status) index, instead of a read of every open task."""
    shapes = open_shapes.kept_for(store, open_shapes.OPEN)
    if shapes is not None:
        held = store.scalar("SELECT COUNT(*) FROM tasks WHERE status = 'leased' AND owner = ?", (member_id,))
        return int(held or 0), sum(shapes.read().values())
    r = store.query(
        "SELECT SUM(status = 'leased' AND owner = ?) AS held, COUNT(*) AS open FROM tasks "
        "WHERE status IN ('queued', 'leased')",
        (member_id,),
    )
    row = r[0] if r else None
    return (int(row["held"] or 0), int(row["open"] or 0)) if row is not None else (0, 0)

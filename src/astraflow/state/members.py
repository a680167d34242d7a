"""Questions about the member rows that the Store's own accessors do not answer."""

from __future__ import annotations

from astraflow.state.store import Store


def member_count(store: Store) -> int:
    """Member rows, whatever their status."""
    return int(store.scalar("SELECT COUNT(*) FROM members") or 0)


def alive_count(store: Store) -> int:
    """Member rows whose status is alive."""
    return int(store.scalar("SELECT COUNT(*) FROM members WHERE status = 'alive'") or 0)


def delete_departed(store: Store, last_seen_before: float) -> list[str]:
    """Delete dead and departed members last seen before this time; returns their ids."""
    where = "status IN ('dead', 'left') AND COALESCE(last_seen, 0) < ?"
    with store.write() as c:
        ids = [str(r[0]) for r in c.execute(f"SELECT id FROM members WHERE {where}", (last_seen_before,))]
        if ids:
            c.execute(f"DELETE FROM members WHERE {where}", (last_seen_before,))
    if ids:
        store.member_changed(None)
    return ids


def touch_alive(store: Store, now: float) -> None:
    """Every member still alive was last seen now (a restarted controller gives each one timeout to
    show up again before its leases go back)."""
    with store.write() as c:
        c.execute("UPDATE members SET last_seen = ? WHERE status = 'alive'", (now,))
    store.member_changed(None)

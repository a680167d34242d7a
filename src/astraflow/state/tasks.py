"""Read-only questions about the task ledger's rows (the ledger itself, state/ledger.py, writes them)."""

from __future__ import annotations

import json

from astraflow.state import open_shapes
from astraflow.state.store import Store

OPEN = ("queued", "leased")
"""Statuses of a task not yet done."""


def leases_held(store: Store, member_id: str) -> int:
    """Tasks leased to this member now."""
    return int(
        store.scalar("SELECT COUNT(*) FROM tasks WHERE status = 'leased' AND owner = ?", (member_id,)) or 0
    )


def open_task_count(store: Store) -> int:
    """Tasks queued or leased."""
    return int(store.scalar("SELECT COUNT(*) FROM tasks WHERE status IN ('queued', 'leased')") or 0)


def task_shapes(store: Store, statuses: tuple[str, ...]) -> list[tuple[dict[str, str], int, list[str], int]]:
    """(roles, group_size, read-only policies, tasks) per task shape among tasks in these statuses
    (from the counts a lease call keeps, state/open_shapes.py, inside one)."""
    kept = open_shapes.kept_for(store, statuses)
    if kept is not None:
        return open_shapes.task_shapes(kept, statuses)
    marks = ",".join("?" for _ in statuses)
    return [
        (json.loads(r["roles"]), int(r["group_size"]), json.loads(r["read_only"] or "[]"), int(r["n"]))
        for r in store.query(
            f"SELECT roles, group_size, read_only, COUNT(*) AS n FROM tasks WHERE status IN ({marks}) "
            "GROUP BY roles, group_size, read_only",
            statuses,
        )
    ]


def open_task_roles(store: Store) -> list[tuple[dict[str, str], list[str], int]]:
    """(roles, read-only policies, tasks) per role map among tasks queued or leased (from the counts
    a lease call keeps, state/open_shapes.py, inside one)."""
    kept = open_shapes.kept_for(store, open_shapes.OPEN)
    if kept is not None:
        return open_shapes.open_task_roles(kept)
    return [
        (json.loads(r["roles"]), json.loads(r["read_only"] or "[]"), int(r["n"]))
        for r in store.query(
            "SELECT roles, read_only, COUNT(*) AS n FROM tasks WHERE status IN ('queued', 'leased') "
            "GROUP BY roles, read_only"
        )
    ]


def newest_open_error(store: Store) -> str:
    """The newest error recorded on a task still queued or leased ('' if none)."""
    rows = store.query(
        "SELECT error FROM tasks WHERE error != '' AND status IN ('queued', 'leased') ORDER BY updated DESC LIMIT 1"
    )
    return str(rows[0]["error"]) if rows else ""


def done_lease_span(store: Store) -> tuple[float, float, float] | None:
    """Over tasks done after a lease: (first lease, last result, summed lease-to-result seconds); None
    when there are none."""
    row = store.query(
        "SELECT MIN(leased_at), MAX(updated), SUM(updated - leased_at) FROM tasks "
        "WHERE status = 'done' AND leased_at > 0"
    )[0]
    return None if row[0] is None else (float(row[0]), float(row[1]), float(row[2]))


def retire_done(store: Store) -> int:
    """Delete done tasks older than every trajectory still in state.db (their results left with a
    retention pass), counting them per owner in retired_tasks; returns how many left. Evaluation
    tasks stay (their rounds read them), and so does the newest task (ids are never reused)."""
    where = (
        "WHERE status = 'done' AND id < (SELECT COALESCE(MIN(task_id), 0) FROM trajectories) "
        "AND id < (SELECT MAX(id) FROM tasks) AND id NOT IN (SELECT task_id FROM eval_tasks)"
    )
    with store.write() as c:
        rows = c.execute(f"SELECT owner, COUNT(*) AS n FROM tasks {where} GROUP BY owner").fetchall()
        if not rows:
            return 0
        c.executemany(
            "INSERT INTO retired_tasks (owner, done) VALUES (?, ?) "
            "ON CONFLICT(owner) DO UPDATE SET done = done + excluded.done",
            [(r["owner"] or "", int(r["n"])) for r in rows],
        )
        c.execute(f"DELETE FROM tasks {where}")
    return sum(int(r["n"]) for r in rows)


def retired_done(store: Store) -> dict[str, int]:
    """Owner -> done tasks of that owner a retention pass deleted (empty for a store without the table)."""
    if not store.scalar("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'retired_tasks'"):
        return {}
    return {r["owner"]: int(r["done"]) for r in store.query("SELECT owner, done FROM retired_tasks")}


def status_counts(store: Store) -> dict[str, int]:
    """Tasks per status (queued, leased, done, failed; zeros included), retired done tasks counted."""
    out = {"queued": 0, "leased": 0, "done": 0, "failed": 0}
    for r in store.query("SELECT status, COUNT(*) AS n FROM tasks GROUP BY status"):
        out[r["status"]] = int(r["n"])
    out["done"] += sum(retired_done(store).values())
    return out


def status_count(store: Store, status: str) -> int:
    """Tasks in one status (an index range of (status, id); retired done tasks not counted)."""
    return int(store.scalar("SELECT COUNT(*) FROM tasks WHERE status = ?", (status,)))


def done_count(store: Store) -> int:
    """Done tasks, retired ones included."""
    return status_count(store, "done") + sum(retired_done(store).values())

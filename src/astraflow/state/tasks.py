"""Read-only questions about the task ledger's rows (the ledger itself, dataflow/ledger.py, writes them)."""

from __future__ import annotations

import json

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
    """(roles, group_size, read-only policies, tasks) per task shape among tasks in these statuses."""
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
    """(roles, read-only policies, tasks) per role map among tasks queued or leased."""
    return [
        (json.loads(r["roles"]), json.loads(r["read_only"] or "[]"), int(r["n"]))
        for r in store.query(
            "SELECT roles, read_only, COUNT(*) AS n FROM tasks WHERE status IN ('queued', 'leased') "
            "GROUP BY roles, read_only"
        )
    ]


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

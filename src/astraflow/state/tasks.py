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

"""Held-out evaluation rounds in state.db: one row per (policy, version) round, one per eval task."""

from __future__ import annotations

import json
from typing import Any

from astraflow.state.store import Store


def open_rounds(store: Store) -> set[tuple[str, int]]:
    """(policy, version) of every round not yet aggregated."""
    return {
        (r["policy"], int(r["version"]))
        for r in store.query("SELECT policy, version FROM eval_rounds WHERE status = 'open'")
    }


def open_eval_tasks(store: Store) -> dict[int, tuple[str, int]]:
    """Task id -> (policy, version) of every eval task whose rewards are not recorded."""
    return {
        int(r["task_id"]): (r["policy"], int(r["version"]))
        for r in store.query("SELECT task_id, policy, version FROM eval_tasks WHERE done = 0")
    }


def round_exists(store: Store, policy: str, version: int) -> bool:
    """Whether a round of (policy, version) was ever queued."""
    return bool(
        store.scalar("SELECT COUNT(*) FROM eval_rounds WHERE policy = ? AND version = ?", (policy, version))
    )


def add_round(store: Store, policy: str, version: int, step: int, tasks: int, now: float) -> None:
    """Record a new open round of `tasks` tasks."""
    with store.write() as c:
        c.execute(
            "INSERT INTO eval_rounds (policy, version, step, status, tasks, metrics, created, finished) "
            "VALUES (?, ?, ?, 'open', ?, '{}', ?, 0)",
            (policy, version, step, tasks, now),
        )


def add_eval_task(store: Store, task_id: int, policy: str, version: int, item: str) -> None:
    """Record that ledger task `task_id` evaluates held-out `item` in round (policy, version)."""
    with store.write() as c:
        c.execute(
            "INSERT INTO eval_tasks (task_id, policy, version, item, rewards, min_version, done) "
            "VALUES (?, ?, ?, ?, '[]', -1, 0)",
            (task_id, policy, version, item),
        )


def record_rewards(store: Store, task_id: int, rewards: list[float], min_version: int) -> None:
    """Store an eval task's per-sample rewards and the oldest version that generated them."""
    with store.write() as c:
        c.execute(
            "UPDATE eval_tasks SET rewards = ?, min_version = ?, done = 1 WHERE task_id = ?",
            (json.dumps(rewards), min_version, task_id),
        )


def tasks_in_flight(store: Store, policy: str, version: int) -> int:
    """The round's tasks still queued or leased in the ledger."""
    return int(
        store.scalar(
            "SELECT COUNT(*) FROM eval_tasks e JOIN tasks t ON t.id = e.task_id "
            "WHERE e.policy = ? AND e.version = ? AND t.status IN ('queued', 'leased')",
            (policy, version),
        )
        or 0
    )


def close_round(
    store: Store, policy: str, version: int, metrics: dict[str, Any], finished: float
) -> list[int]:
    """Mark the round done with its metrics; returns the ids of its tasks never recorded (they failed
    every attempt)."""
    with store.write() as c:
        c.execute(
            "UPDATE eval_rounds SET status = 'done', metrics = ?, finished = ? WHERE policy = ? AND version = ?",
            (json.dumps(metrics, sort_keys=True), finished, policy, version),
        )
        return [
            int(r["task_id"])
            for r in c.execute(
                "SELECT task_id FROM eval_tasks WHERE policy = ? AND version = ? AND done = 0",
                (policy, version),
            ).fetchall()
        ]


def round_step(store: Store, policy: str, version: int) -> int:
    """The trainer step the round's version was published at."""
    return int(
        store.scalar("SELECT step FROM eval_rounds WHERE policy = ? AND version = ?", (policy, version))
    )


def round_results(store: Store, policy: str, version: int) -> tuple[list[tuple[list[float], int]], int]:
    """The recorded tasks' (rewards, min_version) and the round's number of tasks."""
    done = store.query(
        "SELECT rewards, min_version FROM eval_tasks WHERE policy = ? AND version = ? AND done = 1",
        (policy, version),
    )
    total = int(
        store.scalar("SELECT COUNT(*) FROM eval_tasks WHERE policy = ? AND version = ?", (policy, version))
    )
    return [([float(x) for x in json.loads(r["rewards"])], int(r["min_version"])) for r in done], total

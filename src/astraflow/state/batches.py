"""Recorded training batches in state.db: which trajectories each (policy, step) trained on."""

from __future__ import annotations

import json

from astraflow.state.store import Store


def batch_recorded(store: Store, policy: str, step: int) -> bool:
    """Whether the batch of (policy, step) was taken (recorded)."""
    return bool(store.scalar("SELECT 1 FROM batches WHERE policy = ? AND step = ?", (policy, step)))


def batch_ids(store: Store, policy: str, step: int) -> tuple[list[int], list[bool], int] | None:
    """(trajectory ids, replay flags, version) of the recorded batch of (policy, step); None if none."""
    rows = store.query(
        "SELECT traj_ids, replay, version FROM batches WHERE policy = ? AND step = ?", (policy, step)
    )
    if not rows:
        return None
    return json.loads(rows[0]["traj_ids"]), json.loads(rows[0]["replay"]), int(rows[0]["version"])


def last_batch_step(store: Store, policy: str) -> int:
    """The highest step of `policy` whose batch was taken (0 when none)."""
    return int(store.scalar("SELECT COALESCE(MAX(step), 0) FROM batches WHERE policy = ?", (policy,)))


def record_batch(
    store: Store, policy: str, step: int, ids: list[int], flags: list[bool], version: int, now: float
) -> None:
    """Record the batch of (policy, step): its trajectories in order, their replay flags, its version."""
    with store.write() as c:
        c.execute(
            "INSERT INTO batches (policy, step, traj_ids, replay, version, created) VALUES (?, ?, ?, ?, ?, ?)",
            (policy, step, json.dumps(ids), json.dumps(flags), version, now),
        )


def replayed_count(store: Store, policy: str) -> int:
    """Replayed samples over every recorded batch of `policy`."""
    return sum(
        sum(1 for f in json.loads(r["replay"]) if f)
        for r in store.query("SELECT replay FROM batches WHERE policy = ?", (policy,))
    )


def all_batches(store: Store) -> list[tuple[str, int, list[int]]]:
    """(policy, step, trajectory ids) of every recorded batch."""
    return [
        (str(r["policy"]), int(r["step"]), json.loads(r["traj_ids"]))
        for r in store.query("SELECT policy, step, traj_ids FROM batches")
    ]


def forget_batch(store: Store, policy: str, step: int, rebuffer: list[int]) -> None:
    """Delete the batch of (policy, step), never delivered, and buffer again those of `rebuffer` that it
    consumed, so the step is composed anew."""
    with store.write() as c:
        c.execute("DELETE FROM batches WHERE policy = ? AND step = ?", (policy, step))
        c.executemany(
            "UPDATE trajectories SET status = 'buffered', consumed_step = NULL "
            "WHERE id = ? AND consumed_step = ? AND status = 'consumed'",
            [(i, step) for i in rebuffer],
        )

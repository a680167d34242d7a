"""Recorded training batches in state.db: which trajectories each (policy, step) trained on.

A batch's trajectory ids are stored as runs of consecutive ids, `[[first, count], ...]` (a group's
sequences get consecutive ids and a batch is served in task order, so 512 ids are a few dozen runs),
and its replay flags as runs of replayed positions, `[[index, count], ...]`. Rows written before that
hold plain JSON lists (`[id, ...]`, `[false, true, ...]`); both are read.

Which steps of a policy have a recorded batch is asked by every task request (the steps taken, for
admission and the refill), every batch request and every version published. The controller's store
keeps them (`keep_steps`): read once per policy, then changed by `record_batch` and `forget_batch`,
the only statements that write the table, and dropped when a transaction rolls back. A store that
does not keep them (a reader, a test's own store) asks state.db every time.
"""

from __future__ import annotations

import json
import weakref

from astraflow.state import trajectories
from astraflow.state.store import Store


class KeptSteps:
    """One writer's recorded steps per policy, read from state.db when first asked for a policy."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.steps: dict[str, set[int]] = {}
        """Policy -> the steps whose batch is recorded (read at the first question of that policy)."""
        self.last: dict[str, int] = {}
        """Policy -> the highest of those steps (0 when none)."""
        store.on_rollback.append(self.forget)

    def of(self, policy: str) -> set[int]:
        """The recorded steps of a policy."""
        got = self.steps.get(policy)
        if got is None:
            rows = self.store.conn.execute("SELECT step FROM batches WHERE policy = ?", (policy,))
            got = self.steps[policy] = {int(r[0]) for r in rows}
            self.last[policy] = max(got, default=0)
        return got

    def recorded(self, policy: str, step: int) -> None:
        """A batch of (policy, step) was written in the open transaction."""
        if policy in self.steps:
            self.steps[policy].add(step)
            self.last[policy] = max(self.last[policy], step)

    def forgotten(self, policy: str, step: int) -> None:
        """The batch of (policy, step) was deleted in the open transaction."""
        if policy in self.steps:
            got = self.steps[policy]
            got.discard(step)
            self.last[policy] = max(got, default=0)

    def forget(self) -> None:
        """A transaction rolled back: read every policy's steps again when next asked."""
        self.steps.clear()
        self.last.clear()


_kept: weakref.WeakKeyDictionary[Store, KeptSteps] = weakref.WeakKeyDictionary()
"""The stores that keep their recorded steps (the controller's)."""


def keep_steps(store: Store) -> None:
    """Keep the recorded steps of `store` in memory from now on: only for the one writer, whose
    statements are the only ones that change the batches table."""
    if store not in _kept:
        _kept[store] = KeptSteps(store)


def batch_recorded(store: Store, policy: str, step: int) -> bool:
    """Whether the batch of (policy, step) was taken (recorded)."""
    kept = _kept.get(store)
    if kept is not None:
        return step in kept.of(policy)
    return bool(store.scalar("SELECT 1 FROM batches WHERE policy = ? AND step = ?", (policy, step)))


def batch_ids(store: Store, policy: str, step: int) -> tuple[list[int], list[bool], int] | None:
    """(trajectory ids, replay flags, version) of the recorded batch of (policy, step); None if none."""
    rows = store.query(
        "SELECT traj_ids, replay, version FROM batches WHERE policy = ? AND step = ?", (policy, step)
    )
    if not rows:
        return None
    ids = decode_ids(rows[0]["traj_ids"])
    return ids, decode_flags(rows[0]["replay"], len(ids)), int(rows[0]["version"])


def encode_ids(ids: list[int]) -> str:
    """Trajectory ids as JSON runs of consecutive ids: [[first, count], ...]."""
    return json.dumps([[f, n] for f, n in trajectories.id_runs(ids)], separators=(",", ":"))


def decode_ids(text: str) -> list[int]:
    """The ids of a stored batch (runs, or a plain list in rows of older runs)."""
    data = json.loads(text)
    if data and isinstance(data[0], list):
        return [i for first, n in data for i in range(int(first), int(first) + int(n))]
    return [int(i) for i in data]


def encode_flags(flags: list[bool]) -> str:
    """Replay flags as JSON runs of replayed positions: [[index, count], ...] ("[]": none replayed)."""
    runs: list[list[int]] = []
    for k, f in enumerate(flags):
        if not f:
            continue
        if runs and runs[-1][0] + runs[-1][1] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return json.dumps(runs, separators=(",", ":"))


def decode_flags(text: str, n: int) -> list[bool]:
    """The replay flags of a stored batch of n samples (runs, or a plain list in older rows)."""
    data = json.loads(text)
    if data and not isinstance(data[0], list):
        return [bool(f) for f in data]
    flags = [False] * n
    for first, count in data:
        for k in range(int(first), int(first) + int(count)):
            flags[k] = True
    return flags


def consumed_since(store: Store, policy: str, n: int) -> tuple[int, int] | None:
    """(first id, step) such that the batches of `policy` from `step` on consumed at least n
    trajectories, all with ids >= first id (a trajectory is consumed by the step whose batch holds it
    fresh, in the same transaction); None when all its batches together consumed fewer."""
    total, first = 0, None
    # a cursor read as far as needed: the newest few batches, not every step of the run
    rows = store.conn.execute(
        "SELECT step, traj_ids, replay FROM batches WHERE policy = ? ORDER BY step DESC", (policy,)
    )
    for r in rows:
        ids = decode_ids(r["traj_ids"])
        fresh = [i for i, f in zip(ids, decode_flags(r["replay"], len(ids)), strict=True) if not f]
        if fresh:
            total += len(fresh)
            first = min(fresh) if first is None else min(first, min(fresh))
        if total >= n and first is not None:
            return first, int(r["step"])
    return None


def last_batch_step(store: Store, policy: str) -> int:
    """The highest step of `policy` whose batch was taken (0 when none)."""
    kept = _kept.get(store)
    if kept is not None:
        kept.of(policy)
        return kept.last[policy]
    return int(store.scalar("SELECT COALESCE(MAX(step), 0) FROM batches WHERE policy = ?", (policy,)))


def record_batch(
    store: Store, policy: str, step: int, ids: list[int], flags: list[bool], version: int, now: float
) -> None:
    """Record the batch of (policy, step): its trajectories in order, their replay flags, its version."""
    with store.write() as c:
        c.execute(
            "INSERT INTO batches (policy, step, traj_ids, replay, version, created) VALUES (?, ?, ?, ?, ?, ?)",
            (policy, step, encode_ids(ids), encode_flags(flags), version, now),
        )
        kept = _kept.get(store)
        if kept is not None:
            kept.recorded(policy, step)


def _replayed(text: str) -> int:
    """Replayed samples of one stored batch (runs, or a plain list in older rows)."""
    data = json.loads(text)
    if data and isinstance(data[0], list):
        return sum(int(n) for _, n in data)
    return sum(1 for f in data if f)


def replayed_count(store: Store, policy: str) -> int:
    """Replayed samples over every recorded batch of `policy`."""
    return sum(
        _replayed(r["replay"]) for r in store.query("SELECT replay FROM batches WHERE policy = ?", (policy,))
    )


def all_batches(store: Store) -> list[tuple[str, int, list[int]]]:
    """(policy, step, trajectory ids) of every recorded batch."""
    return [
        (str(r["policy"]), int(r["step"]), decode_ids(r["traj_ids"]))
        for r in store.query("SELECT policy, step, traj_ids FROM batches")
    ]


def forget_batch(store: Store, policy: str, step: int, rebuffer: list[int]) -> None:
    """Delete the batch of (policy, step), never delivered, and buffer again those of `rebuffer` that it
    consumed, so the step is composed anew."""
    with store.write() as c:
        c.execute("DELETE FROM batches WHERE policy = ? AND step = ?", (policy, step))
        kept = _kept.get(store)
        if kept is not None:
            kept.forgotten(policy, step)
        trajectories.forget_counts(store)
        if rebuffer:
            trajectories.rebuffered(store, min(rebuffer))
        c.executemany(
            "UPDATE trajectories SET status = 'buffered', consumed_step = NULL "
            "WHERE id = ? AND consumed_step = ? AND status = 'consumed'",
            [(i, step) for i in rebuffer],
        )

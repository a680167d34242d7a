"""Per-policy trajectory buffers and the recorded composition of every training batch.

A trajectory enters as 'buffered' and leaves as 'consumed' (by exactly one step), 'expired'
(too stale when a batch was taken) or never enters ('dropped' by a post-rollout filter). A batch
is chosen, recorded and its trajectories marked consumed in one transaction, so a trainer that
asks again for a step it already received gets the same trajectories in the same order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.data.base import BufferOrder
from astraflow.data.order import EdfOrder, FifoOrder
from astraflow.dataflow.buffered import Array, Buffered, Columns, choose
from astraflow.dataflow.fresh import FreshSamples, sampling
from astraflow.dataflow.limits import RefusedResult, nonfinite_row
from astraflow.dataflow.pending import Pending, min_versions
from astraflow.protocol import sample_columns
from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import PackedSequence, SampleColumns, Sequence, TrainSample
from astraflow.protocol.sample_columns import Block, Ids, Segment
from astraflow.state import batches, trajectories
from astraflow.state.store import Store

TAKEN_KEPT = 8
"""Batches whose fresh items are kept for their step's metrics row (Buffer.taken)."""


@dataclass
class Batch:
    """A recorded batch: its samples in order (as columns), and what taking it did."""

    policy: str
    step: int
    columns: SampleColumns
    version: int
    """Policy version the batch was checked against (staleness reference)."""
    expired: int = 0
    """Trajectories expired while taking this batch."""
    staleness: list[int] = field(default_factory=list)
    """version - min_version of each fresh sample."""
    new: bool = True
    """False when this is a re-delivery of an already recorded batch."""

    @property
    def samples(self) -> list[TrainSample]:
        """The samples cut from the columns (an object per sample: for readers that want them)."""
        return sample_columns.cut(self.columns)


def default_order(kind: str) -> BufferOrder:
    """The built-in order named by PolicyConfig.order."""
    return EdfOrder() if kind == "edf" else FifoOrder()


def min_version(seq: Sequence | PackedSequence) -> int:
    """Oldest version among the tokens this policy generated (-1 when it generated none)."""
    return min_versions([seq if isinstance(seq, PackedSequence) else PackedSequence.of(seq)])[0]


class Buffer:
    """Trajectories of every policy, batches taken from them, and their recorded composition."""

    def __init__(
        self,
        store: Store,
        *,
        order: Callable[[str], BufferOrder] | None = None,
        replay_count: Callable[[str, int], int] | None = None,
    ) -> None:
        self.store = store
        self._order = order or (lambda _policy: EdfOrder())
        self._replay = replay_count or (lambda _policy, _n: 0)
        self._generated: dict[str, int] = {}
        # a rolled-back insert leaves the count too high: count again from the store when next asked
        store.on_rollback.append(self._generated.clear)
        self._fresh = FreshSamples()
        """Buffered groups stored lately, as their joined arrays (dataflow/fresh.py); cleared on a
        rollback: the ids of a rolled-back insert are reused."""
        store.on_rollback.append(self._fresh.forget)
        self._pending: Pending | None = None
        """The groups of the open `grouped` block, written when it ends."""
        self._items: dict[str, Buffered] = {}
        """Policy -> its buffered trajectories as columns (dataflow/buffered.py), as state.db holds
        them: read once by the policy's first batch after a start, then kept by `insert` and
        `next_batch` (the controller is the only writer, and nothing else changes a buffered row's
        status while it runs). Cleared on a rollback, so the next batch reads the store again."""
        store.on_rollback.append(self._items.clear)
        self._taken: dict[tuple[str, int], Columns] = {}
        """(policy, step) -> the columns of the fresh trajectories of the newest batches taken, in id
        order, for the step's metrics row (`taken`); a few steps at most."""

    @contextmanager
    def grouped(self) -> Iterator[None]:
        """A write transaction inside which `insert` hands out ids at once and writes nothing yet: the
        groups are written when the block ends, two statements for all of them (dataflow/pending.py).
        A block inside another joins it."""
        if self._pending is not None:
            yield
            return
        with self.store.write():
            self._pending = Pending(trajectories.max_trajectory_id(self.store) + 1)
            try:
                yield
                pending = self._pending
                stored = pending.write(self.store)
            finally:
                self._pending = None
            for policy, part in stored.items():
                if policy in self._items:
                    self._items[policy].add(part)
            for g in pending.groups:
                if g.status != "buffered":
                    continue
                ids = list(range(g.first_id, g.first_id + g.size))
                if g.cols is None:
                    self._fresh.remember(ids, g.seqs, g.advantages)
                else:
                    self._fresh.remember_columns(ids, *g.cols, g.advantages)

    def insert(
        self,
        task_id: int,
        prompt_key: str,
        group: list[PackedSequence] | list[Sequence],
        advantages: list[float],
        status: str = "buffered",
    ) -> list[int]:
        """Store one group's sequences (one policy) with their advantages; returns trajectory ids
        (inside `grouped`, written when its block ends). The packed arrays are stored as they came
        (protocol/packed.py); lists are packed first."""
        if not group:
            return []
        seqs = [s if isinstance(s, PackedSequence) else PackedSequence.of(s) for s in group]
        # one C-level pass over the group's floats; only a group with a bad one is walked to name it
        if not (all(map(math.isfinite, [s.reward for s in seqs])) and all(map(math.isfinite, advantages))):
            for seq, adv in zip(seqs, advantages, strict=True):
                why = nonfinite_row(seq.reward, adv)
                if why:
                    raise RefusedResult(f"task {task_id}: {why} is not finite; not stored")
        with self.grouped():
            assert self._pending is not None
            ids = self._pending.add(task_id, prompt_key, seqs, list(advantages), status)
        for pol in {seq.policy for seq in seqs}:
            if pol in self._generated:
                self._generated[pol] += sum(1 for seq in seqs if seq.policy == pol)
        return ids

    def insert_columns(
        self,
        task_id: int,
        prompt_key: str,
        cols: tuple[ResultColumns, int, int],
        advantages: list[float],
        status: str = "buffered",
    ) -> list[int]:
        """`insert` of a group that is the sequences a..b-1 of a message's columns (view, a, b), all
        of one policy: stored as they came, no Python object per sequence."""
        view, a, b = cols
        rewards = view.reward_list[a:b]
        if not (
            (view.rewards_finite or all(map(math.isfinite, rewards))) and all(map(math.isfinite, advantages))
        ):
            for reward, adv in zip(rewards, advantages, strict=True):
                why = nonfinite_row(reward, adv)
                if why:
                    raise RefusedResult(f"task {task_id}: {why} is not finite; not stored")
        if self._pending is not None:  # inside a message's block (the usual case): no block of its own
            ids = self._pending.add_columns(task_id, prompt_key, cols, list(advantages), status)
        else:
            with self.grouped():
                assert self._pending is not None
                ids = self._pending.add_columns(task_id, prompt_key, cols, list(advantages), status)
        pol = view.cols.names[int(view.policy[a])]
        if pol in self._generated:
            self._generated[pol] += b - a
        return ids

    def generated(self, policy: str) -> int:
        """Trajectories of a policy ever stored (every status): counted once, then kept up to date by
        `insert` (the controller is the only writer), so a step's metrics do not scan the run."""
        if policy not in self._generated:
            self._generated[policy] = trajectories.count(self.store, policy)
        return self._generated[policy]

    def kept_buffered(self, policy: str) -> int | None:
        """Buffered trajectories of a policy as kept in memory (None while not kept: before its first
        batch after a start, after a rollback, inside an open `grouped` block)."""
        mine = self._items.get(policy)
        return None if mine is None or self._pending is not None else len(mine)

    def kept_groups(self, policy: str) -> int | None:
        """Tasks the policy's kept buffered trajectories came from (None while not kept)."""
        mine = self._items.get(policy)
        return None if mine is None or self._pending is not None else mine.groups()

    def buffered(self, policy: str) -> int:
        """Buffered trajectories of a policy: as kept in memory, else counted in the store."""
        kept = self.kept_buffered(policy)
        return trajectories.count(self.store, policy, "buffered") if kept is None else kept

    def open_counts(self, policy: str) -> dict[str, int]:
        """Trajectories of a policy that are buffered, expired or dropped (`counts` without the consumed,
        which grow with the run: these are index range scans over small sets)."""
        return {"buffered": self.buffered(policy)} | {
            status: trajectories.count(self.store, policy, status) for status in ("expired", "dropped")
        }

    def recorded_ids(self, policy: str, step: int) -> tuple[list[int], list[bool], int] | None:
        """(trajectory ids, replay flags, version) of a recorded batch, without loading its samples."""
        return batches.batch_ids(self.store, policy, step)

    def counts(self, policy: str) -> dict[str, int]:
        """Trajectories of a policy per status: buffered, consumed, expired, dropped."""
        return trajectories.status_counts(self.store, policy)

    def taken(self, policy: str, step: int, fresh_ids: list[int]) -> tuple[Array, Array, Array]:
        """(rewards, oldest versions, task ids) of a recorded batch's fresh trajectories, one array
        each in id order: as kept when this controller took the batch, else read from the store."""
        kept = self._taken.pop((policy, step), None)
        if kept is not None and np.array_equal(kept.traj_id, np.sort(np.asarray(fresh_ids, np.int64))):
            return kept.reward, kept.min_version, kept.task_id
        rows = trajectories.reward_rows(self.store, fresh_ids)
        return (
            np.asarray([r[0] for r in rows], np.float64),
            np.asarray([r[1] for r in rows], np.int64),
            np.asarray([r[2] for r in rows], np.int64),
        )

    def role_metrics(self, traj_ids: list[int]) -> dict[str, float]:
        """Per workflow role of these trajectories: `role/<role>/reward_mean` and `role/<role>/sequences`."""
        out: dict[str, float] = {}
        for role, reward, n in trajectories.role_rewards(self.store, traj_ids):
            out[f"role/{role}/reward_mean"] = reward
            out[f"role/{role}/sequences"] = float(n)
        return out

    def sample_bytes(self, ids: list[int]) -> list[int]:
        """The stored bytes of each trajectory's per-token arrays, in the order of `ids`: what they take
        in a TrainSample (the same packed arrays), read without loading them."""
        if not ids:
            return []
        by_id = trajectories.token_bytes(self.store, ids)
        for i, r in self._archived(ids, by_id).items():
            by_id[i] = sum(len(r[k]) for k in ("tokens", "loss_mask", "logprobs", "versions"))
        return [by_id[i] for i in ids]

    def advantages(self, ids: list[int]) -> list[float]:
        """The stored advantage of each trajectory, in the order of `ids`, read without their tokens."""
        if not ids:
            return []
        by_id = trajectories.advantages(self.store, ids)
        for i, r in self._archived(ids, by_id).items():
            by_id[i] = float(r["advantage"])
        return [by_id[i] for i in ids]

    def _archived(self, ids: list[int], found: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """The rows of `ids` missing from `found` that a retention pass moved to the archive
        (state/archive.py): a recorded batch re-served after its trajectories left state.db."""
        missing = [i for i in ids if i not in found]
        if not missing:
            return {}
        from astraflow.state import archive

        return archive.rows_by_id(self.store, missing)

    def samples(self, ids: list[int], flags: list[bool]) -> list[TrainSample]:
        """The TrainSamples of these trajectories, in this order, with these replay flags."""
        return sample_columns.cut(self.columns(ids, flags))

    def columns(self, ids: list[int], flags: list[bool]) -> SampleColumns:
        """The samples of these trajectories, in this order, with these replay flags, as columns."""
        return self._columns(ids, flags, list(ids))

    def recorded(self, policy: str, step: int) -> Batch | None:
        """The recorded batch of a step, rebuilt from the store (same trajectories, same order)."""
        recorded = batches.batch_ids(self.store, policy, step)
        if recorded is None:
            return None
        ids, flags, version = recorded
        return Batch(policy, step, self.columns(ids, flags), version, new=False)

    def next_batch(
        self, policy: str, step: int, batch_size: int, max_staleness: int, version: int
    ) -> Batch | None:
        """The batch of `step`: the recorded one, else a new one (None when not enough data yet)."""
        again = self.recorded(policy, step)
        if again is not None:
            return again
        with self.store.write():
            # The step trains on the weights of the previous step at the earliest.
            ref = max(version, step - 1)
            mine = self._buffered(policy)
            cols = mine.columns()
            fit = ref - cols.min_version <= max_staleness
            stale = cols.traj_id[~fit].tolist()
            if stale:
                trajectories.expire(self.store, stale)
                self._fresh.take(stale)
                mine.keep(fit)
                cols = mine.columns()
            n_replay = max(0, min(int(self._replay(policy, batch_size)), batch_size))
            replay_ids: list[int] = []
            if n_replay:
                since = batches.consumed_since(self.store, policy, n_replay)
                replay_ids = trajectories.newest_consumed(self.store, policy, n_replay, since)
            n_fresh = batch_size - len(replay_ids)
            if len(mine) < n_fresh:
                # Commit the expirations; the trainer retries once more data arrived.
                return None
            picked = choose(self._order(policy), cols, n_fresh)
            fresh = cols.traj_id[picked].tolist()
            ids = fresh + replay_ids
            flags = [False] * len(fresh) + [True] * len(replay_ids)
            batches.record_batch(self.store, policy, step, ids, flags, ref, time.time())
            trajectories.mark_consumed(self.store, policy, step, fresh)
            left = np.ones(len(mine), bool)
            left[picked] = False
            mine.keep(left)
            # the ids and flags as arrays too: the columns are built without a conversion a sequence
            id_array = np.concatenate((cols.traj_id[picked], np.asarray(replay_ids, np.int64)))
            replay = np.zeros(len(ids), np.uint8)
            replay[len(fresh) :] = 1
            columns = self._columns(id_array, replay, self._fresh.take(ids, id_array))
            by_id = picked[np.argsort(cols.traj_id[picked], kind="stable")]
            self._taken[(policy, step)] = Columns(*(c[by_id] for c in cols))
            while len(self._taken) > TAKEN_KEPT:
                del self._taken[next(iter(self._taken))]
        return Batch(
            policy,
            step,
            columns,
            ref,
            expired=len(stale),
            staleness=(ref - cols.min_version[picked]).tolist(),
        )

    def _buffered(self, policy: str) -> Buffered:
        """The policy's buffered trajectories (read from the store the first time)."""
        mine = self._items.get(policy)
        if mine is None:
            # the row's columns are BufferItem's fields in order (trajectories.buffered_items)
            mine = self._items[policy] = Buffered.of_rows(trajectories.buffered_items(self.store, policy))
        return mine

    def _columns(self, ids: Ids, flags: Ids, found: list[Segment | int]) -> SampleColumns:
        """The columns of `ids`: `found` holds, in their order, runs of kept groups' sequences and the
        ids not kept, which are read from the store (or the archive) as one block."""
        missing = [x for x in found if isinstance(x, int)]
        if missing:
            block = self._read_block(missing)
            at = {i: k for k, i in enumerate(missing)}
            segments: list[Segment] = []
            for x in found:
                if isinstance(x, int):
                    k = at[x]
                    if segments and segments[-1][0] is block and segments[-1][2] == k:
                        segments[-1] = (block, segments[-1][1], k + 1)
                    else:
                        segments.append((block, k, k + 1))
                else:
                    segments.append(x)
        else:
            segments = found  # type: ignore[assignment]
        return sample_columns.join(segments, ids, flags)

    def _read_block(self, ids: list[int]) -> Block:
        """These trajectories read from the store (or the archive), in this order, as one block."""
        by_id: dict[int, Any] = dict(trajectories.sample_rows(self.store, ids))
        by_id.update(self._archived(ids, by_id))
        rows = [by_id[i] for i in ids]
        return Block.of_arrays(
            [(r["tokens"], r["loss_mask"], r["logprobs"], r["versions"]) for r in rows],
            [float(r["reward"]) for r in rows],
            [float(r["advantage"]) for r in rows],
            [sampling(float(r["temperature"]), float(r["top_p"]), int(r["top_k"])) for r in rows],
        )

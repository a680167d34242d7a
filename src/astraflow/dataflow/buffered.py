"""A policy's buffered trajectories as columns: the facts a batch is chosen by (dataflow/buffer.py),
one numpy array per BufferItem field instead of one object per trajectory.

A message's stored groups are appended as one part of plain lists (dataflow/pending.py) and joined
into the arrays when a batch next reads them; a batch removes what it took or expired by one mask.
The built-in orders (EDF, FIFO) rank and take whole groups on the arrays (`choose`); any other
BufferOrder gets the BufferItems it was written for and the same rule in Python, so a plugin's
`sort_key` sees what it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from astraflow.data.base import BufferItem, BufferOrder
from astraflow.data.order import EdfOrder, FifoOrder

Array = np.ndarray[Any, Any]
_DTYPES = (np.int64, np.int64, np.int64, np.int64, np.float64, np.float64, np.int64)


class Columns(NamedTuple):
    """BufferItem's fields, one array each, in the same order (a row of them is a BufferItem)."""

    traj_id: Array
    task_id: Array
    min_version: Array
    arrival: Array
    reward: Array
    advantage: Array
    length: Array


Part = tuple[Sequence[Any] | Array, ...]
"""BufferItem's fields in order as plain sequences, one entry per trajectory: what one write appends."""


def _columns(part: Part) -> Columns:
    return Columns(*(np.asarray(v, dtype) for v, dtype in zip(part, _DTYPES, strict=True)))


def join_parts(parts: list[Part]) -> Part:
    """Several parts as one (the arrays of each field joined)."""
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(c) for c in zip(*(_columns(p) for p in parts), strict=True))


class Buffered:
    """One policy's buffered trajectories (in the order they were kept) as Columns."""

    def __init__(self, part: Part | None = None) -> None:
        self._cols = _columns(part or ((), (), (), (), (), (), ()))
        self._parts: list[Part] = []
        self._n = len(self._cols.traj_id)
        self._tasks: set[int] = set(self._cols.task_id.tolist())
        """The tasks these trajectories came from (admission counts them per task request)."""

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[Any]]) -> Buffered:
        """From rows of BufferItem's fields in order (trajectories.buffered_items)."""
        if not rows:
            return cls()
        return cls(tuple(zip(*rows, strict=True)))

    def add(self, part: Part) -> None:
        """Keep more trajectories (joined into the arrays when next read)."""
        if len(part[0]):
            self._parts.append(part)
            self._n += len(part[0])
            tasks = part[1]
            self._tasks.update(tasks.tolist() if isinstance(tasks, np.ndarray) else tasks)

    def __len__(self) -> int:
        return self._n

    def groups(self) -> int:
        """The tasks these trajectories came from."""
        return len(self._tasks)

    def columns(self) -> Columns:
        """Every kept trajectory's fields, one array each."""
        if self._parts:
            parts = [self._cols, *(_columns(p) for p in self._parts)]
            self._cols = Columns(*(np.concatenate(c) for c in zip(*parts, strict=True)))
            self._parts = []
        return self._cols

    def keep(self, mask: Array) -> None:
        """Keep only the trajectories where `mask` (over `columns()`) is true."""
        cols = self.columns()
        self._cols = Columns(*(c[mask] for c in cols))
        self._n = len(self._cols.traj_id)
        self._tasks = set(self._cols.task_id.tolist())

    def items(self) -> list[BufferItem]:
        """The kept trajectories as BufferItems, in order."""
        return [BufferItem(*row) for row in zip(*(c.tolist() for c in self.columns()), strict=True)]


def choose(order: BufferOrder, cols: Columns, n: int) -> Array:
    """Positions (into `cols`) of the first n trajectories by the order, taking whole groups first
    (a group ranks at its best-ranked sequence) and then filling with parts of groups; in serving
    order: by task, each group by arrival, which does not depend on when results arrived, so the
    trainer's sums over the batch (and a seeded sync run) come out the same from run to run."""
    rank = _rank(order, cols)
    if rank is None:
        return _choose_items(order, cols, n)
    ranked_task = cols.task_id[rank]
    _tasks, first, group, sizes = np.unique(
        ranked_task, return_index=True, return_inverse=True, return_counts=True
    )
    whole = np.zeros(len(first), bool)
    total = 0
    by_rank = np.argsort(first, kind="stable")
    for k, size in zip(by_rank.tolist(), sizes[by_rank].tolist(), strict=True):
        if total + size <= n:
            whole[k] = True
            total += size
        if total == n:
            break
    taken = whole[group]
    picked = rank[taken]
    if total < n:
        picked = np.concatenate((picked, rank[~taken][: n - total]))
    return picked[np.lexsort((cols.arrival[picked], cols.task_id[picked]))]


def _rank(order: BufferOrder, cols: Columns) -> Array | None:
    """Positions in the order's ranking, for the built-in orders (whose keys are columns); None for
    any other order. Both sorts are stable, as Python's sort of the items is."""
    if type(order) is EdfOrder:
        return np.lexsort((cols.arrival, cols.min_version))
    if type(order) is FifoOrder:
        return np.argsort(cols.arrival, kind="stable")
    return None


def _choose_items(order: BufferOrder, cols: Columns, n: int) -> Array:
    """`choose` for an order known only by its `sort_key`: on BufferItems."""
    items = [BufferItem(*row) for row in zip(*(c.tolist() for c in cols), strict=True)]
    at = {it.traj_id: k for k, it in enumerate(items)}
    ranked = sorted(items, key=order.sort_key)
    groups: dict[int, list[BufferItem]] = {}
    for it in ranked:
        groups.setdefault(it.task_id, []).append(it)
    chosen: list[BufferItem] = []
    taken: set[int] = set()
    for members in groups.values():
        if len(chosen) + len(members) <= n:
            chosen.extend(members)
            taken.update(m.traj_id for m in members)
        if len(chosen) == n:
            break
    if len(chosen) < n:
        chosen.extend([it for it in ranked if it.traj_id not in taken][: n - len(chosen)])
    chosen.sort(key=attrgetter("task_id", "arrival"))
    return np.array([at[it.traj_id] for it in chosen], np.int64)

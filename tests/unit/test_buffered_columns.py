"""The buffer's columns (dataflow/buffered.py) choose the batch the per-item rule chose: whole groups
first by their best-ranked sequence, then parts of groups, served by task and arrival; for EDF and
FIFO on numpy arrays, for any other order on BufferItems."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from astraflow.data.base import BufferItem, BufferOrder
from astraflow.data.order import EdfOrder, FifoOrder
from astraflow.dataflow.buffered import Buffered, choose


class LongestFirst(BufferOrder):
    """A plugin's order: known only by its sort_key."""

    def sort_key(self, item: BufferItem) -> tuple[Any, ...]:
        return (-item.length, item.arrival)


def _reference(order: BufferOrder, items: list[BufferItem], n: int) -> list[int]:
    """The rule as the buffer applied it to one BufferItem per trajectory (the ids, in serving order)."""
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
    return [it.traj_id for it in sorted(chosen, key=attrgetter("task_id", "arrival"))]


_ROWS = st.lists(
    st.tuples(st.integers(1, 6), st.integers(0, 4), st.integers(1, 5)), min_size=0, max_size=60
).map(
    # (traj_id, task_id, min_version, arrival, reward, advantage, length); arrival is the id, as stored
    lambda rows: [(i + 10, t, v, i + 10, 0.5 * i, -0.25 * i, n) for i, (t, v, n) in enumerate(rows)]
)


@settings(max_examples=300, deadline=None)
@given(rows=_ROWS, n=st.integers(0, 64), shuffle=st.randoms(use_true_random=False))
def test_choose_on_columns_is_the_per_item_rule(rows: list[tuple[Any, ...]], n: int, shuffle: Any) -> None:
    shuffle.shuffle(rows)  # kept order is insertion order, which a restart reads back in any order
    buffered = Buffered.of_rows(rows)
    items = buffered.items()
    n = min(n, len(items))
    cols = buffered.columns()
    for order in (EdfOrder(), FifoOrder(), LongestFirst()):
        got = cols.traj_id[choose(order, cols, n)].tolist()
        assert got == _reference(order, items, n), type(order).__name__


def test_parts_join_and_a_mask_keeps_the_rest_in_order() -> None:
    b = Buffered.of_rows([(1, 7, 0, 1, 1.0, 0.5, 3)])
    b.add((range(2, 4), [8, 8], [1, 0], range(2, 4), [0.0, 1.0], [-0.5, 0.5], [2, 2]))
    assert len(b) == 3 and b.groups() == 2
    b.add(([], [], [], [], [], [], []))  # a write with nothing buffered for this policy
    assert [it.traj_id for it in b.items()] == [1, 2, 3]
    b.keep(np.array([True, False, True]))
    assert b.items() == [BufferItem(1, 7, 0, 1, 1.0, 0.5, 3), BufferItem(3, 8, 0, 3, 1.0, 0.5, 2)]
    assert b.groups() == 2 and len(Buffered.of_rows([])) == 0

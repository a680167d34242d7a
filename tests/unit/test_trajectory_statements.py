"""The statements that write a message's trajectory rows and mark a batch consumed: many rows per
execution and id ranges, with the same rows and statuses as one row and one id at a time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from astraflow.state import token_groups, trajectories
from astraflow.state.store import Store


def _rows(first: int, n: int) -> list[tuple[object, ...]]:
    return [
        (
            1000 + k,
            "main",
            f"p{k}",
            k / 8,
            -k / 4,
            k % 5,
            k % 3,
            first + k,
            "buffered",
            "r",
            f"g{k}",
            0.5,
            0.9,
            k,
        )
        for k in range(n)
    ]


def _group(first: int, n: int) -> tuple[object, ...]:
    return token_groups.joined_row(
        first, n, b"\x01\x00\x00\x00" * n, (b"\x00" * 4 * n, b"\x01" * n, b"\x00" * 4 * n, b"\x00" * 4 * n)
    )


def test_trajectory_rows_go_in_many_row_executions_exactly_as_given(tmp_path: Path) -> None:
    """`insert_groups` writes rows in executions of 64 and 16 rows and the rest one a time: every
    count around those sizes stores each row's values at the id it was given, and a message whose
    ids SQLite would not give is refused."""
    store = Store.open(tmp_path / "state.db")
    first = 1
    for n in (1, 15, 16, 17, 63, 64, 65, 80, 97, 129):
        rows = _rows(first, n)
        group = _group(first, n)
        with store.write():
            trajectories.insert_groups(store, first, rows, [group])
        got = store.query(
            "SELECT task_id, policy, prompt_key, reward, advantage, length, min_version, arrival, status, "
            "role, group_key, temperature, top_p, top_k, id, consumed_step FROM trajectories "
            "WHERE id >= ? ORDER BY id",
            (first,),
        )
        assert [tuple(r)[:14] for r in got] == rows
        assert [r["id"] for r in got] == list(range(first, first + n))
        assert all(r["consumed_step"] is None for r in got)
        first += n
    with pytest.raises(RuntimeError, match="expected from"), store.write():
        trajectories.insert_groups(store, first + 5, rows[:3], [])
    assert trajectories.max_trajectory_id(store) == first - 1  # rolled back
    store.close()


def test_id_runs_and_a_batch_marked_consumed_by_ranges(tmp_path: Path) -> None:
    """A batch's ids (runs of a group's consecutive ids, in any order, with gaps, repeats and parts of
    groups) are marked consumed exactly: only those ids, only while buffered."""
    assert trajectories.id_runs([]) == []
    assert trajectories.id_runs([7, 8, 9, 3, 3, 4, 20]) == [(7, 3), (3, 1), (3, 2), (20, 1)]
    store = Store.open(tmp_path / "state.db")
    with store.write():
        trajectories.insert_groups(store, 1, _rows(1, 40), [_group(1, 40)])
    trajectories.expire(store, [5])
    batch = [17, 18, 19, 20, 3, 4, 5, 6, 33, 2]
    with store.write():
        trajectories.mark_consumed(store, "main", 9, batch)
    rows = {
        r["id"]: (r["status"], r["consumed_step"])
        for r in store.query("SELECT id, status, consumed_step FROM trajectories")
    }
    for i, (status, step) in rows.items():
        if i == 5:
            assert (status, step) == ("expired", None)
        elif i in batch:
            assert (status, step) == ("consumed", 9)
        else:
            assert (status, step) == ("buffered", None)
    store.close()


def test_role_means_read_by_id_ranges_are_those_of_the_id_list(tmp_path: Path) -> None:
    """`role_rewards` reads a batch's few runs of ids as ranges: per role, the same mean (to the
    float: the rows are summed in the same order), the same count, as the list of ids finds, for
    shuffled, repeated and scattered ids, and past RANGES_AT_MOST runs."""
    rng = random.Random(3)
    store = Store.open(tmp_path / "state.db")
    rows = [
        (
            k // 4,
            "main",
            "p",
            rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-8, 3),
            0.0,
            1,
            0,
            1 + k,
            "buffered",
            rng.choice(["", "a", "b", "critic"]),
            "",
            1.0,
            1.0,
            0,
        )
        for k in range(700)
    ]
    with store.write():
        trajectories.insert_groups(store, 1, rows, [_group(1, 700)])

    def by_list(ids: list[int]) -> list[tuple[str, float, int]]:
        marks = ",".join("?" * len(ids))
        return [
            (r[0], float(r[1]), int(r[2]))
            for r in store.query(
                f"SELECT role, AVG(reward), COUNT(*) FROM trajectories WHERE id IN ({marks}) AND role != '' "
                "GROUP BY role",
                tuple(ids),
            )
        ]

    cases = [list(range(1, 513)), list(range(100, 612))[::-1], [5, 5, 6, 7, 300, 301, 299]]
    cases += [rng.sample(range(1, 701), rng.randint(1, 600)) for _ in range(30)]
    cases += [list(range(1, 700, 2))]  # 350 runs: the list
    for ids in cases:
        assert trajectories.role_rewards(store, ids) == by_list(ids)


def test_role_means_read_nothing_until_a_role_is_named(tmp_path: Path) -> None:
    """A store none of whose trajectories names a role answers `role_rewards` without reading the
    rows; a row that names one, inserted after, or found by a store opened later on the same file,
    is counted as before."""
    path = tmp_path / "state.db"
    store = Store.open(path)
    rows = [(1, "main", "p", 0.25 * k, 0.0, 1, 0, 1 + k, "buffered", "", "", 1.0, 1.0, 0) for k in range(4)]
    with store.write():
        trajectories.insert_groups(store, 1, rows, [_group(1, 4)])
    traced: list[str] = []
    store.conn.set_trace_callback(traced.append)
    assert trajectories.role_rewards(store, [1, 2, 3, 4]) == []
    assert not [q for q in traced if "AVG(reward)" in q]
    named = [
        (2, "main", "p", 0.5 * k, 0.0, 1, 0, 5 + k, "buffered", "critic", "", 1.0, 1.0, 0) for k in range(2)
    ]
    with store.write():
        trajectories.insert_groups(store, 5, named, [_group(5, 2)])
    assert trajectories.role_rewards(store, [1, 2, 3, 4, 5, 6]) == [("critic", 0.25, 2)]
    store.close()
    again = Store.open(path)  # a later start finds the named rows in the file
    assert trajectories.role_rewards(again, [5, 6]) == [("critic", 0.25, 2)]

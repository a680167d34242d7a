"""The statements that write a message's trajectory rows and mark a batch consumed: many rows per
execution and id ranges, with the same rows and statuses as one row and one id at a time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from astraflow.dataflow.buffer import Buffer
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.protocol.columns import ResultColumns
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


def test_the_schema_defaults_are_what_a_row_that_leaves_a_column_out_stores(tmp_path: Path) -> None:
    """A run's layout leaves an optional column out only where the row holds its default: the
    defaults the rows assume are the ones the migrated schema declares."""
    store = Store.open(tmp_path / "state.db")
    declared = {r["name"]: r["dflt_value"] for r in store.query("PRAGMA table_info(trajectories)")}
    for col, value in trajectories.DEFAULTS.items():
        assert store.scalar(f"SELECT {declared[col]}") == value and type(value) is type(
            store.scalar(f"SELECT {declared[col]}")
        ), col


def test_runs_of_every_layout_store_what_full_rows_store(tmp_path: Path) -> None:
    """Random rows (each optional column at its default or not) in runs of random layouts that give
    at least the columns a run's rows hold other than their defaults: every column of every row is
    stored as the full row says, at the id it was given."""
    rng = random.Random(7)
    store = Store.open(tmp_path / "state.db")
    first = 1
    for _ in range(25):
        runs: list[tuple[tuple[str, ...], list[tuple[object, ...]]]] = []
        full: list[tuple[object, ...]] = []
        for _ in range(rng.randint(1, 4)):
            n = rng.choice((1, 5, 16, 17, 64, 70))
            odd = {c for c in trajectories.OPTIONAL if rng.random() < 0.3}
            rows = []
            for k in range(n):
                i = first + len(full)
                values = {
                    "status": "dropped" if "status" in odd and k % 2 else "buffered",
                    "role": "solver" if "role" in odd and k % 3 else "",
                    "group_key": f"g{k}" if "group_key" in odd else "",
                    "temperature": 0.7 if "temperature" in odd else 1.0,
                    "top_p": 0.9 if "top_p" in odd and k % 2 else 1.0,
                    "top_k": k if "top_k" in odd else 0,
                }
                row = (7 + k // 4, "main", f"p{k // 4}", k / 8, -k / 4, k % 5, k % 3, i)
                full.append(row + tuple(values[c] for c in trajectories.OPTIONAL))
                rows.append(values)
            # a layout gives every column some row of the run holds other than its default, and maybe more
            needed = {c for c in trajectories.OPTIONAL for v in rows if v[c] != trajectories.DEFAULTS[c]}
            layout = tuple(c for c in trajectories.OPTIONAL if c in needed or rng.random() < 0.3)
            start = len(full) - n
            runs.append(
                (layout, [full[start + k][:8] + tuple(v[c] for c in layout) for k, v in enumerate(rows)])
            )
        with store.write():
            trajectories.insert_runs(store, first, runs, [])
        got = store.query(
            "SELECT task_id, policy, prompt_key, reward, advantage, length, min_version, arrival, status, "
            "role, group_key, temperature, top_p, top_k, id FROM trajectories WHERE id >= ? ORDER BY id",
            (first,),
        )
        assert [tuple(r)[:14] for r in got] == full
        assert [type(r["top_k"]) for r in got] == [int] * len(full)
        assert [r["id"] for r in got] == list(range(first, first + len(full)))
        first += len(full)
    store.close()


def _sequence(rng: random.Random, policy: str, named: bool) -> m.Sequence:
    n = rng.randint(1, 4)
    sampling = rng.choice(
        (m.SamplingParams(), m.SamplingParams(temperature=0.7), m.SamplingParams(top_p=0.9, top_k=5))
        if named
        else (m.SamplingParams(),)
    )
    return m.Sequence(
        policy=policy,
        tokens=[rng.randint(3, 50) for _ in range(n)],
        loss_mask=[0] + [1] * (n - 1),
        logprobs=[0.0] + [-0.5] * (n - 1),
        versions=[-1] + [rng.randint(0, 3)] * (n - 1),
        reward=rng.random(),
        role=rng.choice(("", "solver")) if named else "",
        group_key=rng.choice(("", "x")) if named else "",
        sampling=sampling,
    )


def test_a_messages_column_groups_store_every_column_as_sequence_groups_do(tmp_path: Path) -> None:
    """The groups of a TaskResults' columns (the row layout found per message) and the same groups
    given as sequences (every column given) store the same rows, every column: messages of default
    roles, keys and sampling (the short layout) and of named ones, buffered or not."""
    rng = random.Random(3)
    for trial in range(30):
        named = trial % 2 == 1
        outcomes, groups = [], []
        for i in range(rng.randint(1, 4)):
            seqs = [_sequence(rng, "main", named) for _ in range(rng.randint(1, 5))]
            outcomes.append(
                m.Outcome(task_id=10 + i, epoch=1, episodes=[m.Episode(sequences=[s]) for s in seqs])
            )
            groups.append(
                (
                    10 + i,
                    f"k{i}",
                    seqs,
                    [rng.random() - 0.5 for _ in seqs],
                    rng.choice(("buffered", "dropped")),
                )
            )
        msg = decode(encode(m.TaskResults.of(outcomes)))
        assert isinstance(msg, m.TaskResults)
        view = ResultColumns(msg)
        by_columns, by_sequences = (Store.open(tmp_path / f"{trial}-{side}.db") for side in ("c", "s"))
        cbuf, sbuf = Buffer(by_columns), Buffer(by_sequences)
        with cbuf.grouped():
            for i, (task, key, _seqs, adv, status) in enumerate(groups):
                cbuf.insert_columns(task, key, (view, view.starts[i], view.starts[i + 1]), adv, status)
        with sbuf.grouped():
            for task, key, seqs, adv, status in groups:
                sbuf.insert(task, key, seqs, adv, status)
        rows = [
            [tuple(r) for r in s.query("SELECT * FROM trajectories ORDER BY id")]
            for s in (by_columns, by_sequences)
        ]
        assert rows[0] == rows[1] and len(rows[0]) == sum(len(g[2]) for g in groups)
        if named:
            assert any(r[11] != "" or r[13] != 1.0 for r in rows[0])  # role, temperature: the long layout ran

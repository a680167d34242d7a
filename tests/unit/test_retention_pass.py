"""A retention pass (state/archive.py `retire`) on a real state.db with every status mixed in: the
rows that leave are exactly those the rule names (written out here as one SQL condition, the rule's
statement), the archive file holds each of them with the bytes it was stored with, a group's arrays
row goes only with its last trajectory, and the scan stops at the newest id the batches up to the
cut consumed. Real SQLite and Parquet files."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from astraflow.dataflow.buffer import Buffer
from astraflow.protocol.messages import PackedSequence, SamplingParams, Sequence
from astraflow.state import archive, batches, token_groups, trajectories
from astraflow.state.store import Store

pytest.importorskip("pyarrow")

RULE = (
    "policy = ? AND id < (SELECT MAX(id) FROM trajectories) AND ((status = 'consumed' AND consumed_step <= ?) "
    "OR (status IN ('expired', 'dropped') AND id <= (SELECT MAX(id) FROM trajectories WHERE policy = ? "
    "AND status = 'consumed' AND consumed_step <= ?)))"
)
"""The rows a pass of `policy` at cut = step - keep_steps takes, as the module docstring states it."""
SMALL = archive._ROW_COLUMNS


def _seq(policy: str, k: int) -> PackedSequence:
    n = 1 + k % 5
    return PackedSequence.of(
        Sequence(
            policy=policy,
            tokens=[k % 97 + i for i in range(n + 2)],
            loss_mask=[0, 0] + [1] * n,
            logprobs=[0.0, 0.0] + [-0.25 * ((k + i) % 7) for i in range(n)],
            versions=[-1, -1] + [k % 4] * n,
            reward=float(k % 3),
            # a few rows hold values other than the columns' usual ones (archive._USUAL)
            sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5) if k % 7 == 3 else SamplingParams(),
            role="judge" if k % 11 == 4 else "",
            group_key=f"g{k % 2}" if k % 13 == 5 else "",
        )
    )


def _run(tmp_path: Path, seed: int) -> tuple[Store, dict[str, list[int]]]:
    """Two policies' groups stored over 12 steps; batches taken in shuffled group order (so later
    steps consume older ids too), some rows expired or dropped, some left buffered."""
    rng = random.Random(seed)
    store = Store.open(tmp_path / "state.db")
    for p in ("main", "other"):
        store.ensure_policy(p, 4)
    buf = Buffer(store)
    ids: dict[str, list[int]] = {"main": [], "other": []}
    k = 0
    for step in range(1, 13):
        groups: dict[str, list[list[int]]] = {"main": [], "other": []}
        for _ in range(4):
            p = rng.choice(("main", "main", "other"))
            size = rng.randint(1, 4)
            with buf.grouped():
                got = buf.insert(100 + k, f"k{k}", [_seq(p, k + j) for j in range(size)], [0.5] * size)
            k += size
            groups[p].append(got)
            ids[p] += got
        for p, gs in groups.items():
            rng.shuffle(gs)
            buffered = [
                i
                for i in ids[p]
                if store.scalar("SELECT status FROM trajectories WHERE id = ?", (i,)) == "buffered"
            ]
            take = rng.sample(buffered, min(len(buffered), rng.randint(0, 6)))
            if take:
                batches.record_batch(store, p, step, take, [False] * len(take), step - 1, 0.0)
                trajectories.mark_consumed(store, p, step, take)
        left = [
            i
            for p in ids
            for i in ids[p]
            if store.scalar("SELECT status FROM trajectories WHERE id = ?", (i,)) == "buffered"
        ]
        if left and rng.random() < 0.5:
            trajectories.expire(store, rng.sample(left, 1))
        if left and rng.random() < 0.3:
            trajectories.mark_dropped(store, rng.sample(left, 1))
    # rows of an older layout (an arrival that is not the id) and a NaN stored as NULL
    every = [i for p in ids for i in ids[p]]
    with store.write() as c:
        c.executemany(
            "UPDATE trajectories SET arrival = arrival + 1000 WHERE id = ?", [(i,) for i in every[3::17]]
        )
        c.executemany("UPDATE trajectories SET reward = NULL WHERE id = ?", [(i,) for i in every[5::23]])
    return store, ids


def _names(rows: list[Any]) -> list[str]:
    return list(rows[0].keys())


def _arrow_type(values: list[Any]) -> Any:
    import pyarrow as pa

    return pa.array(values).type


def _arrays_before(store: Store) -> dict[int, tuple[bytes, bytes, bytes, bytes]]:
    every = [int(r[0]) for r in store.query("SELECT id FROM trajectories")]
    return token_groups.arrays(store, every)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("action", ["archive", "drop"])
def test_a_pass_takes_exactly_the_rule_s_rows_and_archives_their_bytes(
    tmp_path: Path, seed: int, action: str
) -> None:
    store, _ = _run(tmp_path, seed)
    step, keep = 12, 4
    cut = step - keep
    want = store.query(
        f"SELECT {SMALL} FROM trajectories WHERE {RULE} ORDER BY id", ("main", cut, "main", cut)
    )
    assert want, "the generated run must give the pass something to take"
    arrays = _arrays_before(store)
    all_before = {int(r[0]) for r in store.query("SELECT id FROM trajectories")}
    consumed_before = trajectories.count(store, "main", "consumed")

    n = archive.retire(store, tmp_path, "main", step, keep, action)

    taken = [int(r["id"]) for r in want]
    assert n == len(taken)
    after = {int(r[0]) for r in store.query("SELECT id FROM trajectories")}
    assert after == all_before - set(taken)
    # the kept count moved with the table
    assert trajectories.count(store, "main", "consumed") == consumed_before - sum(
        1 for r in want if r["status"] == "consumed"
    )
    # a group's arrays row stays while any of its trajectories is left, and goes with its last one
    firsts = [int(r[0]) for r in store.query("SELECT first_id FROM token_groups")]
    sizes = dict(store.query("SELECT first_id, rows FROM token_groups"))
    for f in firsts:
        assert any(f + j in after for j in range(int(sizes[f]))), f"group {f} kept with none of its rows"
    assert token_groups.arrays(store, after) == {i: arrays[i] for i in after}
    recorded = store.query("SELECT file, status, rows, first_id, last_id FROM archived ORDER BY status")
    counts: dict[str, int] = {}
    for r in want:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    assert {r["status"]: r["rows"] for r in recorded} == counts
    assert {(r["first_id"], r["last_id"]) for r in recorded} == {(taken[0], taken[-1])}
    if action == "drop":
        assert {r["file"] for r in recorded} == {""} and not (tmp_path / "archive").exists()
        return
    (name,) = {r["file"] for r in recorded}
    got = archive.read_file(tmp_path / name)
    assert [int(g["id"]) for g in got] == taken
    # every column of the rows' kind (what a column of the rows' own values would be)
    import pyarrow.parquet as pq

    schema = pq.read_schema(tmp_path / name)
    for c in _names(want):
        assert schema.field(c).type == _arrow_type([r[c] for r in want]), c
    assert any(r["role"] for r in want) and any(r["arrival"] != r["id"] for r in want)
    for g, w in zip(got, want, strict=True):
        assert {c: g[c] for c in w.keys()} == dict(w)
        assert (g["tokens"], g["loss_mask"], g["logprobs"], g["versions"]) == arrays[int(w["id"])]
    # what readers find for an archived id is that row
    assert archive.rows_by_id(store, taken[:3], tmp_path) == {int(g["id"]): g for g in got[:3]}
    store.close()


def test_the_scan_stops_at_the_newest_id_the_batches_up_to_the_cut_consumed(tmp_path: Path) -> None:
    store, _ = _run(tmp_path, 3)
    cut = 6
    newest = max(
        (i for s in range(1, cut + 1) if (b := batches.batch_ids(store, "main", s)) for i in b[0]),
        default=None,
    )
    assert archive._consumed_bound(store, "main", cut) == newest
    # a later pass reads only the batches recorded since, and still finds the maximum of all of them
    later = max(i for s in range(1, 13) if (b := batches.batch_ids(store, "main", s)) for i in b[0])
    assert archive._consumed_bound(store, "main", 12) == later
    # a pass never takes a row above the bound, whatever its status says
    rows_above = store.query("SELECT id FROM trajectories WHERE id > ? AND policy = 'main'", (newest,))
    archive.retire(store, tmp_path, "main", cut + 2, 2, "drop")
    assert {int(r[0]) for r in rows_above} <= {int(r[0]) for r in store.query("SELECT id FROM trajectories")}
    store.close()


@pytest.mark.parametrize("newest_consumed_early", [False, True])
def test_the_rule_s_edges_expired_past_the_newest_consumed_and_the_table_s_newest_row(
    tmp_path: Path, newest_consumed_early: bool
) -> None:
    store = Store.open(tmp_path / "state.db")
    store.ensure_policy("main", 4)
    buf = Buffer(store)

    def group(task: int, size: int) -> list[int]:
        with buf.grouped():
            return buf.insert(task, f"t{task}", [_seq("main", task + j) for j in range(size)], [0.0] * size)

    a, b, c, e = group(1, 4), group(2, 4), group(3, 4), group(4, 2)
    f = group(5, 1)  # the table's newest row
    taken = {
        1: a,
        2: c[:2] + (f if newest_consumed_early else []),
        3: e + ([] if newest_consumed_early else f),
    }
    for step, ids in taken.items():
        batches.record_batch(store, "main", step, ids, [False] * len(ids), step - 1, 0.0)
        trajectories.mark_consumed(store, "main", step, ids)
    trajectories.expire(store, b[:2] + c[2:3])
    trajectories.mark_dropped(store, [b[2], c[3]])
    want = {
        int(r[0]) for r in store.query(f"SELECT id FROM trajectories WHERE {RULE}", ("main", 2, "main", 2))
    }
    before = {int(r[0]) for r in store.query("SELECT id FROM trajectories")}

    assert archive.retire(store, tmp_path, "main", 4, 2, "drop") == len(want)

    left = {int(r[0]) for r in store.query("SELECT id FROM trajectories")}
    assert left == before - want
    if newest_consumed_early:
        # the newest consumed row is the table's newest: it stays, and every expired or dropped row
        # below it leaves
        assert want == set(a + c[:2] + b[:3] + c[2:])
        assert f[0] in left
    else:
        # expired and dropped rows past the newest consumed one (c[1]) stay for a later pass
        assert want == set(a + c[:2] + b[:3])
        assert set(c[2:]) <= left
    assert b[3] in left  # buffered rows never leave
    store.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_pass_a_reader_found_removes_what_the_writer_s_own_pass_would(tmp_path: Path, seed: int) -> None:
    """The archiver's split (state/archiver.py): `find` on a read-only store, `remove` by the writer."""
    store, _ = _run(tmp_path, seed)
    step, keep = 12, 4
    cut = step - keep
    want = [
        int(r[0])
        for r in store.query(
            f"SELECT id FROM trajectories WHERE {RULE} ORDER BY id", ("main", cut, "main", cut)
        )
    ]
    before = {int(r[0]) for r in store.query("SELECT id FROM trajectories")}
    reader = Store.open_readonly(tmp_path / "state.db")
    found = archive.find(reader, tmp_path, "main", step, keep, "archive")
    reader.close()
    assert found is not None and found.rows == len(want)
    assert archive.remove(store, found) == len(want)
    assert {int(r[0]) for r in store.query("SELECT id FROM trajectories")} == before - set(want)
    assert [int(g["id"]) for g in archive.read_file(tmp_path / found.name)] == want
    assert sum(archive.archived_counts(store, "main").values()) == len(want)
    store.close()


def test_a_row_changed_after_a_reader_found_it_leaves_the_pass_undone(tmp_path: Path) -> None:
    store, _ = _run(tmp_path, 0)
    reader = Store.open_readonly(tmp_path / "state.db")
    found = archive.find(reader, tmp_path, "main", 12, 4, "archive")
    reader.close()
    assert found is not None and found.counts.get("consumed")
    before = store.query("SELECT * FROM trajectories ORDER BY id")
    groups_before = store.query("SELECT first_id FROM token_groups ORDER BY first_id")
    consumed = trajectories.count(store, "main", "consumed")
    # one found row is no longer consumed at or before the cut (consumed again at a later step)
    first = int(
        store.scalar("SELECT MIN(id) FROM trajectories WHERE policy = 'main' AND status = 'consumed'")
    )
    assert any(a <= first < a + k for a, k in found.runs)
    with store.write() as c:
        c.execute("UPDATE trajectories SET consumed_step = 99 WHERE id = ?", (first,))
    with pytest.raises(archive.Changed, match="nothing deleted"):
        archive.remove(store, found)
    after = store.query("SELECT * FROM trajectories ORDER BY id")
    assert [(r["id"], r["status"]) for r in after] == [(r["id"], r["status"]) for r in before]
    assert [r[0] for r in store.query("SELECT first_id FROM token_groups ORDER BY first_id")] == [
        r[0] for r in groups_before
    ]
    assert (
        not store.query("SELECT * FROM archived")
        and trajectories.count(store, "main", "consumed") == consumed
    )
    store.close()

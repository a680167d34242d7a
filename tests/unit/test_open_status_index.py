"""The status index of the trajectories that left the buffer untrained and the buffer's floor
(migrations 0011 and 0012, state/trajectories.py `LEFT` and `BUFFERED`): an existing state.db is
carried with every count unchanged, the queries of the expired and dropped use the index and those of
the buffered read from the floor by id, storing and consuming change no index entry, the floor holds
under random batches, expiries, drops, batches forgotten and rows deleted, and replay candidates read
from the newest batches' first id are the newest consumed trajectories, as a read of the whole table
finds them. Real SQLite files."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from sqlite_utils import Database

from astraflow.data.order import EdfOrder
from astraflow.dataflow.buffer import Buffer
from astraflow.protocol.messages import SamplingParams, Sequence
from astraflow.state import batches, migrations, trajectories
from astraflow.state.store import Store

BEFORE = migrations.MIGRATIONS[: [m[0] for m in migrations.MIGRATIONS].index(migrations.OPEN_INDEX_MIGRATION)]
STATUSES = ("buffered", "consumed", "expired", "dropped")


def _old_run(path: Path, n: int) -> None:
    """A state.db as the previous version wrote it (full status index), trajectories of every status."""
    db = Database(sqlite3.connect(str(path), isolation_level=None))
    migrations.apply(db, BEFORE)
    assert "idx_trajectories_status_policy_task_id" in [i.name for i in db["trajectories"].indexes]
    for k in range(n):
        status = STATUSES[k % 4] if k % 3 else "buffered"
        db["trajectories"].insert(
            {
                "task_id": 1 + k // 4,
                "policy": "main" if k % 5 else "other",
                "prompt_key": "k",
                "reward": float(k % 2),
                "advantage": 0.5,
                "length": 2,
                "min_version": 0,
                "arrival": k + 1,
                "status": status,
                "consumed_step": 1 + k // 16 if status == "consumed" else None,
            }
        )
    db.conn.close()


def _plan(store: Store, sql: str, params: tuple[object, ...]) -> str:
    return " ".join(str(r[3]) for r in store.query("EXPLAIN QUERY PLAN " + sql, params))


def _counts(store: Store) -> list[object]:
    return [
        trajectories.status_counts(store, "main"),
        trajectories.status_counts(store, "other"),
        [trajectories.count(store, p, s) for p in ("main", "other") for s in (None, *STATUSES)],
        trajectories.buffered_by_policy(store),
        trajectories.buffered_groups_by_policy(store),
        sorted(tuple(r) for r in trajectories.buffered_items(store, "main")),
        trajectories.newest_consumed(store, "main", 7),
    ]


def test_an_existing_state_db_keeps_its_counts_and_its_index_holds_only_the_left(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _old_run(path, 200)
    old = Store(sqlite3.connect(str(path), isolation_level=None), readonly=False)  # no migration applied
    before = _counts(old)  # read through the full index and without a floor, as before
    old.conn.close()

    store = Store.open(path)  # the controller's opener applies 0011 and 0012
    applied = migrations.applied(store.db)
    assert migrations.OPEN_INDEX_MIGRATION in applied and migrations.BUFFER_FLOOR_MIGRATION in applied
    indexes = {i.name for i in store.db["trajectories"].indexes}
    assert "idx_trajectories_open" not in indexes and "idx_trajectories_left" in indexes
    sql = store.scalar("SELECT sql FROM sqlite_master WHERE name = 'idx_trajectories_left'")
    assert "WHERE status IN ('expired', 'dropped')" in sql
    oldest = store.scalar("SELECT MIN(id) FROM trajectories WHERE status = 'buffered'")
    assert store.scalar("SELECT first_id FROM buffer_floor") == oldest
    assert _counts(store) == before

    # the expired and dropped are read through the index, the buffered by id from the floor
    trajectories.forget_counts(store)  # kept by the writer once read (_counts above): read them again
    traced: list[str] = []
    store.conn.set_trace_callback(traced.append)
    _counts(store)
    store.conn.set_trace_callback(None)
    left = [
        q for q in traced if q.startswith("SELECT") and "FROM trajectories" in q and trajectories.LEFT in q
    ]
    buffered = [
        q for q in traced if q.startswith("SELECT") and "FROM trajectories" in q and "buffer_floor" in q
    ]
    assert len(left) >= 4 and len(buffered) >= 5  # per policy and status; per policy, by policy, the items
    for q in left:
        assert "idx_trajectories_left" in _plan(store, q, ()), q
    for q in buffered:
        plan = _plan(store, q, ())
        assert "INTEGER PRIMARY KEY (rowid>?)" in plan and "idx_trajectories" not in plan, (q, plan)

    # marking consumed changes no index entry and raises the floor to the oldest row still buffered
    entries = "SELECT COUNT(*) FROM trajectories INDEXED BY idx_trajectories_left WHERE " + trajectories.LEFT
    n_left = store.scalar(entries)
    buffered_ids = sorted(int(r[0]) for r in trajectories.buffered_items(store, "main"))
    counts = trajectories.status_counts(store, "main")
    other = sorted(int(r[0]) for r in trajectories.buffered_items(store, "other"))
    trajectories.mark_consumed(store, "main", 99, buffered_ids[:5])
    after = trajectories.status_counts(store, "main")
    assert after["buffered"] == counts["buffered"] - 5 and after["consumed"] == counts["consumed"] + 5
    assert store.scalar(entries) == n_left
    assert store.scalar("SELECT first_id FROM buffer_floor") == min(buffered_ids[5:] + other)
    assert store.scalar("PRAGMA integrity_check") == "ok"


def _scan(store: Store) -> dict[tuple[str, str], int]:
    """(policy, status) -> trajectories, read from every row (no index, no floor)."""
    return {
        (r[0], r[1]): int(r[2])
        for r in store.query(
            "SELECT policy, status, COUNT(*) FROM trajectories NOT INDEXED GROUP BY policy, status"
        )
    }


def test_the_floor_holds_under_random_batches_expiries_drops_forgotten_batches_and_deletes(
    tmp_path: Path,
) -> None:
    """Two policies, random groups stored, batches of random buffered rows consumed (oldest or any),
    rows expired and dropped, batches forgotten (their rows buffered again), old rows deleted as a
    retention pass does (the newest row stays): after every operation no buffered row is below the
    floor and every count read through the floor and the index is the count of a plain scan."""
    rng = random.Random(11)
    store = Store.open(tmp_path / "state.db")
    buf = Buffer(store)
    task, step = 0, 0
    steps: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(300):
        op = rng.random()
        pol = rng.choice(("a", "b"))
        if op < 0.45:
            task += 1
            size = rng.randint(1, 4)
            seqs = [_seq(0, float(i), pol) for i in range(size)]
            buf.insert(task, f"k{task}", seqs, [0.0] * size)
        else:
            ids = sorted(int(r[0]) for r in trajectories.buffered_items(store, pol))
            if not ids:
                continue
            pick = (
                ids[: rng.randint(1, len(ids))]
                if op < 0.7
                else sorted(rng.sample(ids, rng.randint(1, len(ids))))
            )
            if op < 0.8:
                step += 1
                with store.write():
                    trajectories.mark_consumed(store, pol, step, pick)
                    batches.record_batch(store, pol, step, pick, [False] * len(pick), 0, 0.0)
                steps[pol].append(step)
            elif op < 0.85:
                trajectories.expire(store, pick)
            elif op < 0.9:
                trajectories.mark_dropped(store, pick)
            elif op < 0.95 and steps[pol]:
                s = steps[pol].pop(rng.randrange(len(steps[pol])))
                got = batches.batch_ids(store, pol, s)
                assert got is not None
                batches.forget_batch(store, pol, s, got[0])
            else:
                top = store.scalar("SELECT MAX(id) FROM trajectories")
                gone = [
                    int(r[0])
                    for r in store.query(
                        "SELECT id FROM trajectories WHERE status != 'buffered' AND id < ?", (top,)
                    )
                ]
                with store.write() as c:
                    c.executemany(
                        "DELETE FROM trajectories WHERE id = ?",
                        [(i,) for i in rng.sample(gone, len(gone) // 2)],
                    )
                trajectories.forget_counts(store)
        floor = store.scalar("SELECT first_id FROM buffer_floor")
        low = store.scalar("SELECT MIN(id) FROM trajectories WHERE status = 'buffered'")
        assert low is None or low >= floor, (low, floor)
        scan = _scan(store)
        for p in ("a", "b"):
            assert trajectories.status_counts(store, p) == {s: scan.get((p, s), 0) for s in STATUSES}
            assert trajectories.count(store, p, "buffered") == scan.get((p, "buffered"), 0)
        assert trajectories.buffered_by_policy(store) == {
            p: n for (p, s), n in scan.items() if s == "buffered"
        }
    # the floor moved up with the batches: the buffered are read from near the table's end
    assert store.scalar("SELECT first_id FROM buffer_floor") > 1
    assert store.scalar("PRAGMA integrity_check") == "ok"


def _seq(version: int, reward: float, policy: str = "main") -> Sequence:
    return Sequence(
        policy=policy,
        tokens=[1, 1, 1],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.5],
        versions=[-1, version, version],
        reward=reward,
        sampling=SamplingParams(),
    )


def test_replay_candidates_from_the_newest_batches_are_the_newest_consumed(tmp_path: Path) -> None:
    """Batches of random sizes, orders that leave old rows buffered for later steps, replayed
    samples and rows removed from state.db (a retention pass, or rows of the newest steps, which
    the read from the first id must then look past): for every n, the candidates read from
    `consumed_since` are those a read of the whole table finds."""
    rng = random.Random(5)
    store = Store.open(tmp_path / "state.db")
    buf = Buffer(store, order=lambda _p: EdfOrder(), replay_count=lambda _p, n: n // 4)
    task = 0
    for step in range(1, 25):
        for _ in range(rng.randint(2, 5)):
            task += 1
            size = rng.randint(1, 4)
            buf.insert(
                task, f"k{task}", [_seq(rng.randint(0, 3), float(i)) for i in range(size)], [0.0] * size
            )
        buf.next_batch("main", step, rng.randint(3, 8), 100, step)
        if step % 6 == 0:  # some consumed rows leave state.db, old or new
            ids = [int(r[0]) for r in store.query("SELECT id FROM trajectories WHERE status = 'consumed'")]
            gone = rng.sample(ids, len(ids) // 5)
            with store.write() as c:
                c.executemany("DELETE FROM trajectories WHERE id = ?", [(i,) for i in gone])
        for n in (1, 2, 3, 5, 8, 13, 40, 1000):
            since = batches.consumed_since(store, "main", n)
            assert trajectories.newest_consumed(store, "main", n, since) == trajectories.newest_consumed(
                store, "main", n
            )

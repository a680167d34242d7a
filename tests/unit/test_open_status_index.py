"""The status index without the consumed rows (migration 0011, state/trajectories.py `OPEN`): an
existing state.db is carried with every count unchanged, the queries of the other statuses use the
index, marking a batch consumed takes its rows out of it, and replay candidates read from the newest
batches' first id are the newest consumed trajectories, as a read of the whole table finds them.
Real SQLite files."""

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


def test_an_existing_state_db_keeps_its_counts_and_its_index_leaves_the_consumed_out(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _old_run(path, 200)
    old = Store(sqlite3.connect(str(path), isolation_level=None), readonly=False)  # no migration applied
    before = _counts(old)  # read through the full index, as before
    old.conn.close()

    store = Store.open(path)  # the controller's opener applies 0011
    assert migrations.OPEN_INDEX_MIGRATION in migrations.applied(store.db)
    indexes = {i.name for i in store.db["trajectories"].indexes}
    assert "idx_trajectories_status_policy_task_id" not in indexes and "idx_trajectories_open" in indexes
    sql = store.scalar("SELECT sql FROM sqlite_master WHERE name = 'idx_trajectories_open'")
    assert "WHERE status != 'consumed'" in sql
    assert _counts(store) == before

    # every query of a status other than consumed is served by the index (it names its condition)
    traced: list[str] = []
    store.conn.set_trace_callback(traced.append)
    _counts(store)
    store.conn.set_trace_callback(None)
    open_queries = [
        q
        for q in traced
        if q.startswith("SELECT") and "FROM trajectories" in q and ("status =" in q or "status IN" in q)
        if "status = 'consumed'" not in q
        and not (trajectories._ANY_STATUS in q and trajectories.OPEN not in q)
    ]
    assert len(open_queries) >= 7  # counts of each open status, per policy, the buffered items
    for q in open_queries:
        assert "idx_trajectories_open" in _plan(store, q, ()), q

    # marking consumed takes rows out of the index: they are counted as consumed, not as buffered
    buffered = [int(r[0]) for r in trajectories.buffered_items(store, "main")][:5]
    counts = trajectories.status_counts(store, "main")
    trajectories.mark_consumed(store, "main", 99, buffered)
    after = trajectories.status_counts(store, "main")
    assert after["buffered"] == counts["buffered"] - 5 and after["consumed"] == counts["consumed"] + 5
    assert store.scalar("PRAGMA integrity_check") == "ok"


def _seq(version: int, reward: float) -> Sequence:
    return Sequence(
        policy="main",
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

"""What a retention pass leaves of the ledger and the batches: done tasks older than every kept
trajectory leave state.db with their count kept per owner (migration 0008), and a batch row holds
runs of ids; rows written before either change still read the same. Real state.db files."""

from __future__ import annotations

import json
from pathlib import Path

from astraflow.state import batches, tasks
from astraflow.state.store import Store


def _task(store: Store, status: str, owner: str) -> int:
    with store.write() as c:
        cur = c.execute(
            "INSERT INTO tasks (prompt_key, sample, roles, group_size, status, owner, epoch, attempts, "
            "lease_expiry, created, updated) VALUES ('p', '{}', '{\"solver\": \"main\"}', 1, ?, ?, 1, 0, 0, 0, 0)",
            (status, owner),
        )
        return int(cur.lastrowid or 0)


def _trajectory(store: Store, task_id: int) -> None:
    with store.write() as c:
        c.execute(
            "INSERT INTO trajectories (task_id, policy, prompt_key, reward, advantage, length, min_version, "
            "arrival, status) VALUES (?, 'main', 'p', 0, 0, 1, 0, 0, 'buffered')",
            (task_id,),
        )


def test_done_tasks_older_than_every_kept_trajectory_leave_and_stay_counted(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    ids = [_task(store, "done", owner) for owner in ("a", "a", "b", "a", "b")]
    failed = _task(store, "failed", "b")
    with store.write() as c:  # an evaluation task is read by its round: it stays
        c.execute(
            "INSERT INTO eval_tasks (task_id, policy, version, item) VALUES (?, 'main', 1, '{}')", (ids[1],)
        )
    _trajectory(store, ids[3])  # tasks from ids[3] on still have results in state.db
    queued = _task(store, "queued", "")
    before = tasks.status_counts(store)
    assert tasks.retire_done(store) == 2  # ids[0] (a) and ids[2] (b)
    left = {int(r["id"]) for r in store.query("SELECT id FROM tasks")}
    assert left == {ids[1], ids[3], ids[4], failed, queued}
    assert tasks.retired_done(store) == {"a": 1, "b": 1}
    assert tasks.status_counts(store) == before == {"queued": 1, "leased": 0, "done": 5, "failed": 1}
    assert tasks.retire_done(store) == 0  # nothing more until the kept trajectories leave
    with store.write() as c:
        c.execute("DELETE FROM trajectories")
    # with no trajectory left nothing is known to be retired: COALESCE(MIN, 0) keeps every task
    assert tasks.retire_done(store) == 0
    _trajectory(store, queued)
    assert tasks.retire_done(store) == 2  # ids[3] (a), ids[4] (b); the eval task stays
    assert tasks.retired_done(store) == {"a": 2, "b": 2}
    assert tasks.status_counts(store)["done"] == 5
    store.close()


def test_batch_rows_are_runs_and_old_rows_still_read(tmp_path: Path) -> None:
    ids = [7, 8, 9, 10, 40, 41, 3, 100]
    flags = [False, False, False, False, False, True, True, True]
    text = batches.encode_ids(ids)
    assert json.loads(text) == [[7, 4], [40, 2], [3, 1], [100, 1]]
    assert batches.decode_ids(text) == ids
    assert json.loads(batches.encode_flags(flags)) == [[5, 3]]
    assert batches.decode_flags(batches.encode_flags(flags), len(ids)) == flags
    assert batches.decode_flags(batches.encode_flags([False] * 3), 3) == [False] * 3
    assert batches.encode_ids([]) == "[]" and batches.decode_ids("[]") == []
    for odd in ([5], [5, 5, 6], [9, 8, 7], [1, 2, 4, 5, 6, 3]):  # repeats and descending ids: runs of one
        assert batches.decode_ids(batches.encode_ids(odd)) == odd
    assert json.loads(batches.encode_ids([5, 5, 6])) == [[5, 1], [5, 2]]
    store = Store.open(tmp_path / "state.db")
    batches.record_batch(store, "main", 1, ids, flags, 0, 0.0)
    with store.write() as c:  # a row as older versions wrote it: plain JSON lists
        c.execute(
            "INSERT INTO batches (policy, step, traj_ids, replay, version, created) VALUES ('main', 2, ?, ?, 1, 0)",
            (json.dumps(ids), json.dumps(flags)),
        )
    assert batches.batch_ids(store, "main", 1) == (ids, flags, 0)
    assert batches.batch_ids(store, "main", 2) == (ids, flags, 1)
    assert batches.replayed_count(store, "main") == 6
    store.close()

"""The consumed, expired and dropped trajectories per policy, kept by the writer
(state/trajectories.py, _COUNTS): counted once, then equal to a count of the table after every
statement that moves rows in or out of those statuses (a batch, a forgotten batch, an expiry, a
filter's dropped groups, dropped rows, a retention pass, a rolled-back write), and never counted by
reading the table again while the kept counts hold, which is what a status request and every step's
metrics row of a long run cost otherwise (the consumed rows have no index; the expired and dropped
ones grow with the run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.dataflow.buffer import Buffer
from astraflow.protocol.messages import PackedSequence, SamplingParams, Sequence
from astraflow.state import archive, batches, trajectories
from astraflow.state.store import Store

SCAN = "status = 'consumed' AND policy"
"""What the statement that counts consumed rows by reading the table says."""


def _seq(policy: str, k: int) -> PackedSequence:
    return PackedSequence.of(
        Sequence(
            policy=policy,
            tokens=[k, k + 1, k + 2],
            loss_mask=[0, 1, 1],
            logprobs=[0.0, -0.5, -0.25],
            versions=[-1, 0, 0],
            reward=float(k % 2),
            sampling=SamplingParams(),
        )
    )


def _scanned(store: Store, policy: str) -> int:
    return int(
        store.scalar("SELECT COUNT(*) FROM trajectories WHERE status = 'consumed' AND policy = ?", (policy,))
    )


def _counted(store: Store, policy: str) -> tuple[int, list[str]]:
    """The consumed count status reports, and the statements that read the table for it."""
    traced: list[str] = []
    store.conn.set_trace_callback(traced.append)
    try:
        n = trajectories.status_counts(store, policy)["consumed"]
    finally:
        store.conn.set_trace_callback(None)
    return n, [q for q in traced if SCAN in q]


def _stored(tmp_path: Path, groups: int) -> tuple[Store, Buffer, list[list[int]], list[int]]:
    """A state.db of two policies: `groups` groups of four of "main" and one of "other", buffered."""
    store = Store.open(tmp_path / "state.db")
    for policy in ("main", "other"):
        store.ensure_policy(policy, 4)
    buf = Buffer(store)
    main = [
        buf.insert(t, f"p{t}", [_seq("main", 4 * t + k) for k in range(4)], [0.0] * 4) for t in range(groups)
    ]
    other = buf.insert(99, "q", [_seq("other", k) for k in range(4)], [0.0] * 4)
    return store, buf, main, other


def test_the_writer_keeps_consumed_counts_equal_to_the_table_without_reading_it(tmp_path: Path) -> None:
    store, _buf, main, other = _stored(tmp_path, 6)

    def agrees(policy: str = "main", scans: int = 0) -> int:
        n, scanned = _counted(store, policy)
        assert n == _scanned(store, policy), policy
        assert len(scanned) == scans, scanned
        return n

    assert agrees(scans=1) == 0  # counted once by reading the table
    assert agrees() == 0  # then kept
    # a batch: its own policy's rows only (the other policy's ids in the list are left buffered)
    with store.write():
        batches.record_batch(store, "main", 1, main[0] + main[1], [False] * 8, 0, 0.0)
        trajectories.mark_consumed(store, "main", 1, main[0] + main[1] + other)
    assert agrees() == 8
    assert agrees("other", scans=1) == 0
    # a write rolled back: forgotten, counted again
    with pytest.raises(RuntimeError), store.write():
        trajectories.mark_consumed(store, "main", 2, main[2])
        raise RuntimeError("abort")
    assert agrees(scans=1) == 8
    # a batch forgotten and composed again: its rows buffered again
    with store.write():
        batches.record_batch(store, "main", 2, main[2], [False] * 4, 1, 0.0)
        trajectories.mark_consumed(store, "main", 2, main[2])
    assert agrees() == 12
    batches.forget_batch(store, "main", 2, main[2][:2])
    assert agrees(scans=1) == 10
    # dropped rows (a poisoned batch's consumed ones among them)
    trajectories.mark_dropped(store, main[2][2:] + main[0][:1])
    assert agrees(scans=1) == 7
    # an expiry touches only buffered rows: a consumed id in the list stays consumed, nothing recounted
    trajectories.expire(store, main[3] + main[1][:1])
    assert agrees() == 7
    # a retention pass takes away what it deleted, without reading the table again
    with store.write():
        batches.record_batch(store, "main", 3, main[4], [False] * 4, 2, 0.0)
        trajectories.mark_consumed(store, "main", 3, main[4])
    assert agrees() == 11
    left = archive.retire(store, tmp_path, "main", 4, keep_steps=2, action="drop")
    assert left > 0
    assert agrees() == 4  # main[4], consumed at step 3, is kept
    # a reader in another process counts by reading the table
    reader = Store.open_readonly(tmp_path / "state.db")
    n, scanned = _counted(reader, "main")
    assert n == 4 and len(scanned) == 1
    reader.close()
    store.close()


LEFT_SCAN = "status IN ('expired', 'dropped') AND status = "
"""What the statement that counts expired or dropped rows through the status index says."""


def test_the_writer_keeps_expired_and_dropped_counts_equal_to_the_table(tmp_path: Path) -> None:
    store, buf, main, other = _stored(tmp_path, 8)
    scans: list[str] = []
    store.conn.set_trace_callback(lambda q: scans.append(q) if LEFT_SCAN in q else None)

    def agrees(read: int = 0) -> None:
        before = len(scans)
        for policy in ("main", "other"):
            counts = trajectories.status_counts(store, policy)
            for status in ("expired", "dropped"):
                table = store.scalar(
                    "SELECT COUNT(*) FROM trajectories WHERE +status = ? AND policy = ?", (status, policy)
                )
                assert counts[status] == table == trajectories.count(store, policy, status), (policy, status)
        assert len(scans) - before == read, scans[before:]

    agrees(read=4)  # each policy's two counts read once through the index
    agrees()  # then kept
    # an expiry, of one policy's rows and another's: each policy's count moves by its own rows
    trajectories.expire(store, main[0] + other[:1])
    agrees()
    # an expiry touches only buffered rows: an expired id again changes nothing
    trajectories.expire(store, main[0][:2])
    agrees()
    # a post-rollout filter's dropped groups are stored dropped: counted as they are written
    with buf.grouped():
        buf.insert(7, "d", [_seq("main", 100 + k) for k in range(3)], [0.0] * 3, status="dropped")
        buf.insert(8, "e", [_seq("main", 200 + k) for k in range(4)], [0.0] * 4)
    buf.insert(9, "f", [_seq("other", 300 + k) for k in range(2)], [0.0] * 2, status="dropped")
    agrees()
    # a write rolled back: the counts are forgotten and read again
    with pytest.raises(RuntimeError), store.write():
        trajectories.expire(store, main[1])
        raise RuntimeError("abort")
    agrees(read=4)
    # rows dropped by id (a poisoned batch's): forgotten, read again
    trajectories.mark_dropped(store, main[2][:2] + main[0][:1])
    agrees(read=4)
    # a retention pass takes away what it deleted (expired and dropped rows below the newest consumed)
    with store.write():
        batches.record_batch(store, "main", 1, main[3], [False] * 4, 0, 0.0)
        trajectories.mark_consumed(store, "main", 1, main[3])
    with store.write():
        batches.record_batch(store, "main", 5, main[5], [False] * 4, 4, 0.0)
        trajectories.mark_consumed(store, "main", 5, main[5])
    assert archive.retire(store, tmp_path, "main", 6, keep_steps=2, action="drop") > 0
    agrees()
    store.conn.set_trace_callback(None)
    store.close()

"""Per-token arrays in a table of their own, one row per stored group (state/token_groups.py, migration
0010): a state.db of the earlier layout (arrays in the trajectory rows) is refused by read-only readers
and converted by the controller's opener with every sample's bytes unchanged; a retention pass deletes
a group row only when none of its trajectories is left. Real SQLite files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlite_utils import Database

from astraflow.dataflow.buffer import Buffer
from astraflow.protocol.messages import PackedSequence, SamplingParams, Sequence
from astraflow.state import archive, batches, migrations, token_groups, trajectories, views
from astraflow.state.store import StateError, Store

BEFORE = migrations.MIGRATIONS[
    : [m[0] for m in migrations.MIGRATIONS].index(migrations.TOKEN_GROUPS_MIGRATION)
]


def _seq(k: int) -> PackedSequence:
    n = 2 + k % 4
    return PackedSequence.of(
        Sequence(
            policy="main",
            tokens=[100 * k + i for i in range(n + 1)],
            loss_mask=[0] + [1] * n,
            logprobs=[0.0] + [-0.125 * (k + i) for i in range(n)],
            versions=[-1] + [k % 3] * n,
            reward=float(k % 2),
            sampling=SamplingParams(),
        )
    )


def _old_run(tmp_path: Path, seqs: list[PackedSequence]) -> Path:
    """A state.db as the previous version wrote it: packed arrays in each trajectory row."""
    path = tmp_path / "state.db"
    db = Database(sqlite3.connect(str(path), isolation_level=None))
    migrations.apply(db, BEFORE)
    for k, s in enumerate(seqs):
        db["trajectories"].insert(
            {
                "task_id": 1 + k // 2,
                "policy": "main",
                "prompt_key": "k",
                "tokens": s.tokens,
                "loss_mask": s.loss_mask,
                "logprobs": s.logprobs,
                "versions": s.versions,
                "reward": s.reward,
                "advantage": 0.5,
                "length": 2,
                "min_version": 0,
                "arrival": k + 1,
                "status": "buffered",
            }
        )
    db.conn.close()
    return path


def test_an_earlier_state_db_is_refused_read_only_then_converted_with_the_same_bytes(tmp_path: Path) -> None:
    seqs = [_seq(k) for k in range(5)]
    path = _old_run(tmp_path, seqs)
    ro = views.open_for_reading(path)
    with pytest.raises(StateError, match="their own table"):
        views.recent_samples(ro, "main")
    ro.conn.close()

    store = Store.open(path)  # the controller's opener applies 0010
    assert "tokens" not in store.db["trajectories"].columns_dict
    assert store.scalar("SELECT COUNT(*) FROM token_groups") == len(seqs)
    got = Buffer(store).samples(list(range(1, 6)), [False] * 5)
    for s, g in zip(seqs, got, strict=True):
        assert (g.tokens, g.loss_mask, g.logprobs, g.versions) == (
            s.tokens,
            s.loss_mask,
            s.logprobs,
            s.versions,
        )
    shown = views.recent_samples(store, "main", with_logprobs=True)
    assert [(smp.tokens, smp.logprobs) for smp in reversed(shown)] == [
        (s.unpack().tokens, s.unpack().logprobs) for s in seqs
    ]
    assert trajectories.token_bytes(store, [1, 5]) == {1: 13 * 3, 5: 13 * 3}
    store.close()


def test_groups_hold_consecutive_ids_and_slice_back_to_each_sequence(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    buf = Buffer(store)
    a = buf.insert(1, "a", [_seq(k) for k in range(3)], [0.0] * 3)
    b = buf.insert(2, "b", [_seq(k) for k in range(3, 7)], [0.0] * 4)
    rows = store.query("SELECT first_id, rows FROM token_groups ORDER BY first_id")
    assert [(r[0], r[1]) for r in rows] == [(a[0], 3), (b[0], 4)]
    found = token_groups.arrays(store, [a[2], b[0], b[3]])
    for i, k in ((a[2], 2), (b[0], 3), (b[3], 6)):
        s = _seq(k)
        assert found[i] == (s.tokens, s.loss_mask, s.logprobs, s.versions)
    assert set(found) == {a[2], b[0], b[3]}
    assert token_groups.token_counts(store, a + b) == {i: len(_seq(k).loss_mask) for k, i in enumerate(a + b)}
    store.close()


def test_a_retention_pass_deletes_a_group_row_only_when_it_is_empty(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    store.ensure_policy("main", 4)
    buf = Buffer(store)
    a = buf.insert(1, "a", [_seq(k) for k in range(4)], [0.0] * 4)
    b = buf.insert(2, "b", [_seq(k) for k in range(4, 8)], [0.0] * 4)
    c = buf.insert(3, "c", [_seq(8)], [0.0])  # the table's newest row stays: ids are never reused
    # as a batch is taken (dataflow/buffer.py): recorded, then its rows marked consumed
    batches.record_batch(store, "main", 1, a + b[:2], [False] * 6, 0, 0.0)
    trajectories.mark_consumed(store, "main", 1, a + b[:2])  # b's other half is still buffered
    assert archive.retire(store, tmp_path, "main", 5, keep_steps=2, action="drop") == 6
    assert [r[0] for r in store.query("SELECT first_id FROM token_groups ORDER BY first_id")] == [b[0], c[0]]
    left = Buffer(store).samples(b[2:] + c, [False] * 3)
    assert [s.tokens for s in left] == [_seq(k).tokens for k in (6, 7, 8)]
    store.close()

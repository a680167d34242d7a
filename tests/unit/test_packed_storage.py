"""Migration 0009: a state.db written before protocol 6 (per-token msgpack lists) is converted to packed
arrays when a controller opens it, read-only readers refuse it until then, and a run with archive files
of the old format is refused with the reason (nothing converted). Real SQLite files; the old rows are
written here as the previous version's Buffer wrote them (msgpack lists)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest
from sqlite_utils import Database

from astraflow.dataflow.buffer import Buffer
from astraflow.state import migrations, views
from astraflow.state.store import StateError, Store

BEFORE = migrations.MIGRATIONS[: [m[0] for m in migrations.MIGRATIONS].index(migrations.PACKED_MIGRATION)]
TOKENS, MASK, LOGPROBS, VERSIONS = [7, 8, 9, 10], [0, 0, 1, 1], [0.0, 0.0, -0.1, -2.5], [-1, -1, 3, 4]


def _old_run(tmp_path: Path, *, archived: bool = False) -> Path:
    path = tmp_path / "state.db"
    db = Database(sqlite3.connect(str(path), isolation_level=None))
    migrations.apply(db, BEFORE)
    enc = msgspec.msgpack.Encoder()
    db["trajectories"].insert(
        {
            "task_id": 1,
            "policy": "main",
            "prompt_key": "k",
            "tokens": enc.encode(TOKENS),
            "loss_mask": enc.encode(MASK),
            "logprobs": enc.encode(LOGPROBS),
            "versions": enc.encode(VERSIONS),
            "reward": 1.0,
            "advantage": 0.5,
            "length": 2,
            "min_version": 3,
            "arrival": 1,
            "status": "buffered",
        }
    )
    if archived:
        db["archived"].insert(
            {"file": "archive/main-1-1.parquet", "policy": "main", "status": "consumed", "rows": 1}
        )
    db.conn.close()
    return path


def test_an_old_state_db_is_refused_read_only_then_converted_by_the_controller(tmp_path: Path) -> None:
    path = _old_run(tmp_path)
    ro = views.open_for_reading(path)
    with pytest.raises(StateError, match="protocol 5 and earlier"):
        views.recent_samples(ro, "main")
    ro.conn.close()

    store = Store.open(path)  # the controller's opener applies 0009
    assert migrations.PACKED_MIGRATION in migrations.applied(store.db)
    (sample,) = Buffer(store).samples([1], [False])
    assert sample.tokens == b"".join(t.to_bytes(4, "little", signed=True) for t in TOKENS)
    assert sample.loss_mask == bytes(MASK)
    assert sample.token_list() == TOKENS and sample.mask_list() == MASK and sample.version_list() == VERSIONS
    assert sample.logprob_list() == pytest.approx(LOGPROBS, rel=1e-7)  # float32 now
    (shown,) = views.recent_samples(store, "main")
    assert shown.tokens == TOKENS and shown.versions == VERSIONS
    store.close()


def test_a_run_with_old_archive_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    path = _old_run(tmp_path, archived=True)
    with pytest.raises(
        StateError, match="archive/ files hold token lists in the msgpack format of protocol 5 and earlier"
    ):
        Store.open(path)
    db = Database(sqlite3.connect(str(path), isolation_level=None))
    assert migrations.PACKED_MIGRATION not in migrations.applied(db)
    blob = db.execute("SELECT tokens FROM trajectories").fetchone()[0]
    assert msgspec.msgpack.decode(blob) == TOKENS  # rolled back: still the old format

"""State store: migrations, WAL, write transactions, typed queries, read-only opener."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlite_utils import Database

from astraflow.state import migrations
from astraflow.state.store import StateError, Store

ALL = [name for name, _ in migrations.MIGRATIONS]


def test_migration_0001_creates_every_table(tmp_path: Path) -> None:
    db = Database(sqlite3.connect(str(tmp_path / "s.db"), isolation_level=None))
    assert migrations.apply(db) == ALL
    names = set(db.table_names())
    for t in (
        "runs",
        "policies",
        "versions",
        "members",
        "tasks",
        "trajectories",
        "batches",
        "stage_state",
        "metrics",
        "events",
        "migrations",
    ):
        assert t in names, t
    assert {"status", "epoch", "owner", "lease_expiry", "attempts"} <= set(db["tasks"].columns_dict)
    assert {"min_version", "arrival", "consumed_step"} <= set(db["trajectories"].columns_dict)
    assert "tokens" not in db["trajectories"].columns_dict  # its arrays live in token_groups (0010)
    assert {"first_id", "rows", "lengths", "tokens", "loss_mask"} <= set(db["token_groups"].columns_dict)
    assert {"role", "group_key", "temperature", "top_p", "top_k"} <= set(db["trajectories"].columns_dict)
    assert {"policy", "version", "status", "metrics"} <= set(db["eval_rounds"].columns_dict)
    assert {"task_id", "rewards", "min_version", "done"} <= set(db["eval_tasks"].columns_dict)
    assert migrations.apply(db) == []
    assert migrations.applied(db) == ALL


def test_migrations_are_append_only_and_atomic(tmp_path: Path) -> None:
    db = Database(sqlite3.connect(str(tmp_path / "s.db"), isolation_level=None))
    migrations.apply(db)

    def broken(d: Database) -> None:
        d["extra"].create({"id": int}, pk="id")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        migrations.apply(db, [*migrations.MIGRATIONS, ("0099_broken", broken)])
    assert "extra" not in db.table_names()
    assert migrations.applied(db) == ALL

    def good(d: Database) -> None:
        d["extra"].create({"id": int}, pk="id")

    assert migrations.apply(db, [*migrations.MIGRATIONS, ("0099_good", good)]) == ["0099_good"]
    assert migrations.applied(db) == [*ALL, "0099_good"]


def test_store_wal_and_write_rollback(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "state.db")
    assert s.scalar("PRAGMA journal_mode") == "wal"
    s.ensure_policy("main", 1)
    with pytest.raises(ValueError):
        with s.write():
            s.record_version("main", 1, 1, "tcp://x")
            raise ValueError("abort")
    assert s.policy("main")["version"] == 0
    with s.write():
        with s.write():  # nested writes join the outer transaction
            s.record_version("main", 1, 1, "tcp://x", "abc", 10)
    assert s.policy("main") == {"name": "main", "max_staleness": 1, "version": 1, "step": 1}
    assert s.record_version("main", 1, 1, "tcp://y") is False  # re-announce refreshes the address
    assert s.latest_versions()[0]["weights_addr"] == "tcp://y"
    s.close()


def test_store_run_members_stage_metrics_persist(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "state.db")
    assert s.init_run("r", {"run": {"steps": 3}}, "sha") is True
    assert s.init_run("r", {"run": {"steps": 3}}) is False
    s.upsert_member("raas-0", "raas", policies=["main"], region="eu", hardware="cpu:2", slots=4, now=10.0)
    assert s.touch_member("raas-0", 11.0, {"main": 2})
    s.set_member_status("raas-0", "dead")
    assert not s.touch_member("raas-0", 12.0)
    s.save_stage_state("main", 0, "Greso", {"p": 0.5})
    s.add_metrics("main", 1, {"reward_mean": 0.25})
    s.add_event("start", "r")
    s.close()
    r = Store.open_readonly(tmp_path / "state.db")
    assert r.run()["recipe"] == {"run": {"steps": 3}}
    mem = r.member("raas-0")
    assert (
        mem is not None and mem["status"] == "dead" and mem["loaded"] == {"main": 2} and mem["region"] == "eu"
    )
    assert r.load_stage_state("main") == {0: ("Greso", {"p": 0.5})}
    assert r.last_metrics("main") == {"reward_mean": 0.25}
    assert [e["kind"] for e in r.events()] == ["start"]
    with pytest.raises(StateError):
        with r.write():
            pass
    with pytest.raises(sqlite3.OperationalError):
        r.conn.execute("DELETE FROM events")
    r.close()


def test_open_readonly_missing_file(tmp_path: Path) -> None:
    with pytest.raises(StateError):
        Store.open_readonly(tmp_path / "nope.db")


def test_synchronous_setting_applies_and_is_checked(tmp_path: Path) -> None:
    full = Store.open(tmp_path / "full.db", synchronous="full")
    normal = Store.open(tmp_path / "normal.db")
    try:
        assert full.scalar("PRAGMA synchronous") == 2 and normal.scalar("PRAGMA synchronous") == 1
    finally:
        full.close()
        normal.close()
    with pytest.raises(ValueError, match="synchronous"):
        Store.open(tmp_path / "x.db", synchronous="off")

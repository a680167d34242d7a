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


def test_latest_versions_are_each_policys_newest_read_by_key_seeks(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "state.db")
    assert s.latest_versions() == []
    for name in ("zeta", "alpha", "mid"):
        s.ensure_policy(name, 1)
    for v in (1, 3, 2):  # out of order: the newest is the largest version, not the last recorded
        s.record_version("zeta", v, v, f"tcp://z{v}", f"z{v}", v)
        s.record_version("alpha", 10 * v, v, f"tcp://a{v}")
    want = [
        {"policy": "alpha", "version": 30, "step": 3, "weights_addr": "tcp://a3", "sha256": "", "nbytes": 0},
        {"policy": "zeta", "version": 3, "step": 3, "weights_addr": "tcp://z3", "sha256": "z3", "nbytes": 3},
    ]
    assert s.latest_versions() == want  # "mid" has no version: left out
    # what the GROUP BY it replaced gave, on the same rows
    rows = s.query(
        "SELECT v.policy, v.version, v.step, v.weights_addr, v.sha256, v.nbytes FROM versions v "
        "JOIN (SELECT policy, MAX(version) AS mv FROM versions GROUP BY policy) m "
        "ON v.policy = m.policy AND v.version = m.mv ORDER BY v.policy"
    )
    assert [dict(r) for r in rows] == want
    # every statement it runs is a seek in the (policy, version) key, none a scan of the table
    plans: list[str] = []
    s.conn.set_trace_callback(plans.append)
    s.latest_versions()
    s.conn.set_trace_callback(None)
    for sql in plans:
        for row in s.conn.execute("EXPLAIN QUERY PLAN " + sql):
            assert "SEARCH" in row[3] and "SCAN" not in row[3], (sql, row[3])
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

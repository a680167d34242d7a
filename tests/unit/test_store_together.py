"""`Store.together()`: the writes of several units share one transaction and one COMMIT; a unit (or a
write inside one) that raises is rolled back alone, its rollback holders reload, and nothing is
visible to another connection before the block ends."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from astraflow.state.store import StateError, Store


def _store(tmp_path: Path) -> tuple[Store, list[str]]:
    """A store with one events-writing table and a trace of the statements that end transactions."""
    store = Store.open(tmp_path / "state.db")
    ends: list[str] = []
    store.conn.set_trace_callback(
        lambda sql: ends.append(sql) if sql in ("BEGIN IMMEDIATE", "COMMIT", "ROLLBACK") else None
    )
    return store, ends


def _kinds(path: Path) -> list[str]:
    """The events' kinds as another connection (a reader such as `astraflow status`) sees them."""
    reader = Store.open_readonly(path)
    try:
        return [r["kind"] for r in reader.query("SELECT kind FROM events ORDER BY id")]
    finally:
        reader.close()


def test_units_share_one_commit_that_readers_see_only_at_the_end(tmp_path: Path) -> None:
    store, ends = _store(tmp_path)
    with store.together():
        for kind in ("a", "b", "c"):
            with store.unit(), store.write():
                store.add_event(kind)
            assert _kinds(tmp_path / "state.db") == []  # nothing is on disk before the block ends
    assert _kinds(tmp_path / "state.db") == ["a", "b", "c"]
    assert ends == ["BEGIN IMMEDIATE", "COMMIT"]


def test_nothing_written_opens_no_transaction(tmp_path: Path) -> None:
    store, ends = _store(tmp_path)
    with store.together():
        with store.unit():
            store.query("SELECT COUNT(*) FROM events")
    assert ends == [] and not store.conn.in_transaction


def test_a_failing_unit_is_rolled_back_alone_and_its_holders_reload(tmp_path: Path) -> None:
    store, ends = _store(tmp_path)
    reloads: list[int] = []
    store.on_rollback.append(lambda: reloads.append(len(store.query("SELECT id FROM events"))))
    with store.together():
        with store.unit():
            store.add_event("kept-before")
        with pytest.raises(RuntimeError), store.unit():
            store.add_event("lost")
            with store.write():  # a nested write joins the unit: rolled back with it
                store.add_event("lost-too")
            raise RuntimeError("the message's handler failed")
        with store.unit():
            store.add_event("kept-after")
    assert _kinds(tmp_path / "state.db") == ["kept-before", "kept-after"]
    assert reloads == [1]  # the holders reloaded once, seeing the earlier unit's row and not the lost ones
    assert ends == ["BEGIN IMMEDIATE", "COMMIT"]


def test_a_write_that_raises_inside_a_unit_undoes_only_itself(tmp_path: Path) -> None:
    # a handler that catches a refused write (results.py: RefusedResult) goes on with the rest
    store, _ = _store(tmp_path)
    with store.together(), store.unit():
        store.add_event("first")
        with pytest.raises(ValueError), store.write():
            store.add_event("refused")
            raise ValueError("refused")
        store.add_event("second")
    assert _kinds(tmp_path / "state.db") == ["first", "second"]


def test_a_block_that_raises_commits_nothing(tmp_path: Path) -> None:
    store, ends = _store(tmp_path)
    with pytest.raises(KeyError), store.together():
        with store.unit():
            store.add_event("a")
        raise KeyError("the loop itself failed")
    assert _kinds(tmp_path / "state.db") == []
    assert ends == ["BEGIN IMMEDIATE", "ROLLBACK"] and not store.conn.in_transaction


def test_a_transaction_sqlite_ended_is_not_committed(tmp_path: Path) -> None:
    # a statement that makes SQLite roll back the whole transaction (as disk full does): the earlier
    # unit's write is gone, so the block raises instead of letting its message be answered
    store, _ = _store(tmp_path)
    with pytest.raises(StateError, match="rolled back the shared transaction"), store.together():
        with store.unit():
            store.add_event("gone")
        with pytest.raises(sqlite3.OperationalError), store.unit(), store.write():
            store.conn.execute("ROLLBACK")  # stands in for SQLite's own rollback
            store.conn.execute("SELECT * FROM no_such_table")
    assert _kinds(tmp_path / "state.db") == []
    assert not store.conn.in_transaction


def test_outside_together_each_write_commits_as_before(tmp_path: Path) -> None:
    store, ends = _store(tmp_path)
    for kind in ("a", "b"):
        with store.unit(), store.write():
            store.add_event(kind)
    assert ends == ["BEGIN IMMEDIATE", "COMMIT"] * 2

"""The typed reads that the stall report, the benchmarks and the dashboard's bench tab ask state.db,
over a real store with rows written as the controller leaves them."""

from __future__ import annotations

from pathlib import Path

from sqlite_utils import Database

from astraflow.state import tasks, trajectories, versions
from astraflow.state.store import Store


def _store(tmp_path: Path) -> Store:
    store = Store.open(tmp_path / "state.db")
    db = Database(store.conn)
    with store.write():
        db["tasks"].insert_all(
            [
                # done after a lease: 10 -> 14 and 12 -> 20
                {"id": 1, "roles": "{}", "status": "done", "leased_at": 10.0, "updated": 14.0, "error": ""},
                {"id": 2, "roles": "{}", "status": "done", "leased_at": 12.0, "updated": 20.0, "error": ""},
                # done without a lease (never counted), and two open tasks with errors (newest wins)
                {"id": 3, "roles": "{}", "status": "done", "leased_at": 0.0, "updated": 30.0, "error": ""},
                {
                    "id": 4,
                    "roles": "{}",
                    "status": "queued",
                    "leased_at": 0.0,
                    "updated": 5.0,
                    "error": "old\nfirst failure",
                },
                {
                    "id": 5,
                    "roles": "{}",
                    "status": "leased",
                    "leased_at": 5.5,
                    "updated": 6.0,
                    "error": "Trace\nnew failure",
                },
                {
                    "id": 6,
                    "roles": "{}",
                    "status": "done",
                    "leased_at": 0.0,
                    "updated": 7.0,
                    "error": "a done task's error",
                },
            ]
        )
        db["trajectories"].insert_all(
            [
                {"task_id": 1, "policy": "a", "length": 3, "reward": 1.0},
                {"task_id": 1, "policy": "a", "length": 4, "reward": 1.0},
                {"task_id": 2, "policy": "b", "length": 5, "reward": 0.0},
                {"task_id": 3, "policy": "a", "length": 100, "reward": 0.0},
            ]
        )
        store.record_version("a", 3, 3, "tcp://127.0.0.1:1")
        store.record_version("b", 9, 2, "tcp://127.0.0.1:1")
    return store


def test_reads_answer_from_the_rows(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        assert tasks.newest_open_error(store) == "Trace\nnew failure"
        assert tasks.done_lease_span(store) == (10.0, 20.0, 12.0)
        # trajectories of tasks whose result came in [13, 25]: task 1 (at 14) and task 2 (at 20)
        assert trajectories.generated_between(store, 13.0, 25.0) == {"a": (2, 7), "b": (1, 5)}
        assert trajectories.generated_between(store, 15.0, 19.0) == {}
        assert versions.newest_version(store) == 9
    finally:
        store.close()


def test_reads_of_an_empty_store(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    try:
        assert tasks.newest_open_error(store) == ""
        assert tasks.done_lease_span(store) is None
        assert trajectories.generated_between(store, 0.0, 1e12) == {}
        assert versions.newest_version(store) == 0
    finally:
        store.close()

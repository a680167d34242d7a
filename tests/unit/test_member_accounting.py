"""Per-member accounting on a real store: whose failure counts, quarantine, share cap, heartbeat
rate limit and de-duplicated errors; migration 0005 adds the member columns."""

from __future__ import annotations

from pathlib import Path

from astraflow.config.load import validate_recipe
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.state.store import Store


def _setup(tmp_path: Path, *workers: str) -> tuple[Store, MemberAccounting]:
    recipe = validate_recipe(
        {
            "policy": [{"name": "main", "model": "m"}],
            "controller": {"quarantine_after": 4, "quarantine_s": 60},
        }
    )
    store = Store.open(tmp_path / "state.db")
    for w in workers:
        store.upsert_member(w, "raas", policies=["main"])
    return store, MemberAccounting(store, recipe)


def test_migration_0005_adds_member_counters(tmp_path: Path) -> None:
    store, _ = _setup(tmp_path, "raas-0")
    row = store.member("raas-0")
    assert row is not None
    assert (row["failures"], row["invalid"], row["expiries"], row["quarantined"]) == (0, 0, 0, "")
    store.close()


def test_a_lone_workers_failures_count(tmp_path: Path) -> None:
    store, acc = _setup(tmp_path, "raas-0")
    member = store.member("raas-0")
    assert member is not None
    assert all(acc.failed(member, "failures", now=0.0) for _ in range(10))
    assert acc.may_lease(store.member("raas-0") or {}, now=0.0)  # never quarantined alone
    store.close()


def test_a_failing_member_beside_a_healthy_one_is_quarantined(tmp_path: Path) -> None:
    store, acc = _setup(tmp_path, "bad", "good")
    for _ in range(5):
        acc.succeeded("good")
    counted = [acc.failed(store.member("bad") or {}, "failures", now=100.0) for _ in range(6)]
    assert not any(counted), "its failures were charged to the tasks"
    bad = store.member("bad") or {}
    assert bad["failures"] == 6 and bad["quarantined"]
    assert not acc.may_lease(bad, now=101.0)
    # the healthy one's occasional failure still counts against its task
    assert acc.failed(store.member("good") or {}, "failures", now=101.0)
    # alone, the quarantined member is leased again; after quarantine_s it is released
    store.set_member_status("good", "dead")
    assert acc.may_lease(bad, now=102.0)
    store.set_member_status("good", "alive")
    assert acc.may_lease(bad, now=100.0 + 61) and not (store.member("bad") or {})["quarantined"]
    store.close()


def test_heartbeat_errors_are_recorded_once(tmp_path: Path) -> None:
    store, acc = _setup(tmp_path, "raas-0")
    assert acc.new_error("raas-0", "boom") and not acc.new_error("raas-0", "boom")
    assert acc.new_error("raas-0", "other")
    store.close()

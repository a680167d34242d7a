"""Per-member accounting on a real store: whose failure counts, quarantine, share cap, heartbeat
rate limit and de-duplicated errors; migration 0005 adds the member columns."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.bench.control import recipe as bench_recipe
from astraflow.config.load import validate_recipe
from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
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


def test_a_pruned_member_is_forgotten(tmp_path: Path) -> None:
    """What accounting keeps of a member (its recent outcomes, its last error) goes when its row is
    pruned, forget_after_s after its death: memory does not grow with every member id ever seen."""
    r = bench_recipe(0.5, 2)
    r["controller"] = {**r["controller"], "member_timeout_s": 5.0, "forget_after_s": 30.0}
    c = Controller(Recipe.model_validate(r), tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    for ident in ("w0", "w1"):
        hello = m.Hello(member_id=ident, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1)
        assert isinstance(c.dispatch(ident.encode(), hello)[0][1], m.Welcome)
        c.dispatch(ident.encode(), m.Heartbeat(error=f"{ident} failed once"))
        c.accounting.succeeded(ident)
    assert set(c.accounting.recent) == set(c.accounting.last_error) == {"w0", "w1"}
    t = time.time()
    c.members.touch("w0", t + 20.0)
    c.tick(t + 20.0)  # w1 silent past member_timeout_s: dead, but remembered until it is pruned
    assert {row["id"]: row["status"] for row in c.store.members()} == {"w0": "alive", "w1": "dead"}
    assert "w1" in c.accounting.recent and "w1" in c.accounting.last_error
    c.members.touch("w0", t + 60.0)
    c.tick(t + 60.0)  # w1 dead for longer than forget_after_s: its row and its accounting go
    assert [row["id"] for row in c.store.members()] == ["w0"]
    assert set(c.accounting.recent) == set(c.accounting.last_error) == {"w0"}

"""Task ledger: leases, epochs, expiry, release, renew, failures; every task done exactly once."""

from __future__ import annotations

import random
from pathlib import Path

from astraflow.state.ledger import Ledger
from astraflow.state.store import Store

ROLES = {"actor": "main"}


def _ledger(tmp_path: Path, **kw: object) -> tuple[Store, Ledger]:
    store = Store.open(tmp_path / "state.db")
    clock = {"t": 0.0}
    led = Ledger(
        store, lease_timeout_s=10.0, max_attempts=kw.pop("max_attempts", 5), clock=lambda: clock["t"]
    )  # type: ignore[arg-type]
    return store, led


def test_lease_complete_duplicate_stale_unknown(tmp_path: Path) -> None:
    _, led = _ledger(tmp_path)
    ids = [led.enqueue(f"k{i}", {"i": i}, ROLES, 4) for i in range(3)]
    got = led.lease("a", 2, now=0.0)
    assert [t.id for t in got] == ids[:2] and all(t.epoch == 1 and t.owner == "a" for t in got)
    assert got[0].sample == {"i": 0} and got[0].group_size == 4 and got[0].policies == ["main"]
    assert led.counts() == {"queued": 1, "leased": 2, "done": 0, "failed": 0}
    assert led.complete(ids[0], 1, "b") == "stale_epoch"  # not this owner's lease
    assert led.complete(ids[0], 2, "a") == "stale_epoch"  # wrong epoch
    assert led.complete(ids[0], 1, "a") == "accepted"
    assert led.complete(ids[0], 1, "a") == "duplicate"
    assert led.complete(999, 1, "a") == "unknown_task"
    assert led.complete(ids[2], 0, "") == "stale_epoch"  # never leased


def test_expiry_requeues_and_old_epoch_is_rejected(tmp_path: Path) -> None:
    _, led = _ledger(tmp_path)
    tid = led.enqueue("k", {}, ROLES, 2)
    (t1,) = led.lease("a", 1, now=0.0)
    assert led.renew("a", now=5.0) == 1  # heartbeat: expiry now 15
    assert led.expire(now=12.0) == 0
    assert led.expire(now=16.0) == 1
    assert led.get(tid).status == "queued" and led.get(tid).attempts == 1
    (t2,) = led.lease("b", 1, now=16.0)
    assert t2.epoch == t1.epoch + 1
    assert led.complete(tid, t1.epoch, "a") == "stale_epoch"  # late result of the expired lease
    assert led.complete(tid, t2.epoch, "b") == "accepted"


def test_late_result_accepted_while_nobody_took_over(tmp_path: Path) -> None:
    _, led = _ledger(tmp_path)
    tid = led.enqueue("k", {}, ROLES, 2)
    (t,) = led.lease("a", 1, now=0.0)
    led.expire(now=100.0)
    assert led.complete(tid, t.epoch, "a") == "accepted"
    assert led.lease("b", 1, now=100.0) == []


def test_release_member_and_fail_after_max_attempts(tmp_path: Path) -> None:
    _, led = _ledger(tmp_path, max_attempts=2)
    a, b = led.enqueue("a", {}, ROLES, 1), led.enqueue("b", {}, ROLES, 1)
    led.lease("w1", 2, now=0.0)
    assert led.release_member("w1") == 2
    assert led.counts()["queued"] == 2 and led.counts()["leased"] == 0
    (t,) = led.lease("w2", 1, now=1.0, accept=lambda task: task.prompt_key == "b")
    assert t.id == b
    assert led.fail(b, t.epoch, "w2", "boom") == "requeued"
    (t,) = led.lease("w2", 1, now=1.0, accept=lambda task: task.prompt_key == "b")
    assert led.fail(b, t.epoch - 1, "w2") == "stale_epoch"
    assert led.fail(b, t.epoch, "w2", "boom") == "failed"
    assert led.get(b).status == "failed" and led.get(b).attempts == 2
    assert led.complete(b, t.epoch, "w2") == "stale_epoch"
    assert led.get(a).status == "queued"


def test_every_task_done_exactly_once_under_chaos(tmp_path: Path) -> None:
    """Workers lease, die, hang past expiry, deliver late and duplicate results; each task is accepted once."""
    store, led = _ledger(tmp_path, max_attempts=1000)
    rng = random.Random(7)
    n_tasks = 60
    for i in range(n_tasks):
        led.enqueue(f"k{i}", {"i": i}, ROLES, 2)
    accepted: dict[int, int] = {}
    outstanding: list[tuple[int, int, str, float]] = []  # (task, epoch, owner, deliver_at)
    now = 0.0
    for _ in range(4000):
        now += rng.uniform(0.1, 3.0)
        w = f"w{rng.randrange(5)}"
        for t in led.lease(w, rng.randrange(0, 4), now=now):
            outstanding.append((t.id, t.epoch, w, now + rng.uniform(0.5, 25.0)))  # some exceed the 10 s lease
        if rng.random() < 0.05:
            led.release_member(f"w{rng.randrange(5)}")
        led.expire(now)
        rng.shuffle(outstanding)
        keep = []
        for item in outstanding:
            tid, ep, owner, at = item
            if at > now:
                keep.append(item)
                continue
            if rng.random() < 0.1:  # the worker died: never delivers
                continue
            status = led.complete(tid, ep, owner)
            if status == "accepted":
                accepted[tid] = accepted.get(tid, 0) + 1
            if rng.random() < 0.2:  # a retransmitted duplicate
                assert led.complete(tid, ep, owner) in ("duplicate", "stale_epoch")
        outstanding = keep
        if led.counts()["done"] == n_tasks:
            break
    assert led.counts() == {"queued": 0, "leased": 0, "done": n_tasks, "failed": 0}
    assert sorted(accepted) == list(range(1, n_tasks + 1))
    assert set(accepted.values()) == {1}
    store.close()


def test_complete_many_is_complete_for_each_result_in_order(tmp_path: Path) -> None:
    store, led = _ledger(tmp_path)
    ids = [led.enqueue(f"k{i}", {"i": i}, ROLES, 4) for i in range(5)]
    led.lease("a", 3, now=0.0)
    led.lease("b", 1, now=0.0)
    assert led.counts()["done"] == 0
    got = led.complete_many(
        [(ids[0], 1), (ids[1], 2), (ids[0], 1), (ids[3], 1), (999, 1), (ids[4], 0), (ids[2], 1)], "a"
    )
    # the second result for ids[0] in the same message is a duplicate; ids[3] is b's lease
    assert got == [
        "accepted",
        "stale_epoch",
        "duplicate",
        "stale_epoch",
        "unknown_task",
        "stale_epoch",
        "accepted",
    ]
    assert [led.get(i).status for i in ids] == ["done", "leased", "done", "leased", "queued"]  # type: ignore[union-attr]
    assert led.counts() == {"queued": 1, "leased": 2, "done": 2, "failed": 0}
    assert led.complete_many([(ids[0], 1), (ids[1], 1)], "a") == ["duplicate", "accepted"]
    assert led.complete_many([], "a") == []
    assert store.scalar("SELECT COUNT(*) FROM tasks WHERE status = 'done'") == 3


def test_lease_and_enqueue_many_write_what_they_return(tmp_path: Path) -> None:
    store, led = _ledger(tmp_path)
    led.enqueue_many([(f"k{i}", {"i": i}, ["other"] if i == 1 else []) for i in range(700)], ROLES, 4)
    rows = store.query("SELECT id, prompt_key, read_only FROM tasks ORDER BY id")
    assert [r["prompt_key"] for r in rows] == [f"k{i}" for i in range(700)]
    assert [r["read_only"] for r in rows[:3]] == ["[]", '["other"]', "[]"]
    got = led.lease("a", 600, now=3.0)  # more than one statement's worth of ids
    assert len(got) == 600 and got[1].read_only == ["other"] and got[5].sample == {"i": 5}
    stored = {r["id"]: r for r in store.query("SELECT * FROM tasks WHERE status = 'leased'")}
    assert sorted(stored) == [t.id for t in got]
    assert all(
        (
            stored[t.id]["epoch"],
            stored[t.id]["owner"],
            stored[t.id]["lease_expiry"],
            stored[t.id]["leased_at"],
        )
        == (t.epoch, "a", 13.0, 3.0)
        for t in got
    )
    again = led.lease("b", 200, now=4.0)
    assert [t.id for t in again] == [r["id"] for r in rows[600:]]
    assert led.complete_many([(t.id, t.epoch) for t in got], "a") == ["accepted"] * 600

"""Admission: production capped at (S+1) batches; leases gated on the worker's loaded version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow.dataflow.admission import Admission, PolicyLimits
from astraflow.dataflow.buffer import Buffer
from astraflow.protocol.messages import SamplingParams, Sequence
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store

ROLES = {"actor": "main"}
G = 2  # group size
B = 2 * G  # two prompts per batch


def _setup(tmp_path: Path, staleness: int) -> tuple[Store, Ledger, Buffer, Admission]:
    store = Store.open(tmp_path / "s.db")
    store.ensure_policy("main", staleness)
    return store, Ledger(store), Buffer(store), Admission(store, {"main": PolicyLimits(B, staleness)})


def _finish(led: Ledger, buf: Buffer, member: str, version: int) -> None:
    for t in led.lease(member, 100):
        assert led.complete(t.id, t.epoch, member) == "accepted"
        seqs = [
            Sequence(
                policy="main",
                tokens=[1, 2],
                loss_mask=[0, 1],
                logprobs=[0.0, -1.0],
                versions=[-1, version],
                sampling=SamplingParams(),
            )
            for _ in range(G)
        ]
        buf.insert(t.id, t.prompt_key, seqs, [0.0] * G)


def _fill(led: Ledger, adm: Admission) -> int:
    n = adm.tasks_to_admit(ROLES, G)
    for i in range(n):
        led.enqueue(f"k{i}", {}, ROLES, G)
    return n


def test_s0_production_is_synchronous(tmp_path: Path) -> None:
    store, led, buf, adm = _setup(tmp_path, 0)
    for step in range(1, 4):
        version = step - 1
        assert _fill(led, adm) == B // G  # exactly one batch of work
        assert _fill(led, adm) == 0  # nothing more while it is outstanding
        assert adm.may_lease({"main": version}, ["main"])
        assert not adm.may_lease({"main": version - 1}, ["main"]) or version == 0
        _finish(led, buf, "w", version)
        assert adm.outstanding() == {"main": B}
        assert _fill(led, adm) == 0  # buffered but not yet trained: still no new work
        batch = buf.next_batch("main", step, B, 0, version)
        assert batch is not None and batch.expired == 0 and batch.staleness == [0] * B
        # the batch was taken: new work is admitted, but a worker still on the old weights gets none
        assert _fill(led, adm) == B // G
        assert not adm.may_lease({"main": version}, ["main"])
        store.record_version("main", step, step, "tcp://t")
        assert adm.may_lease({"main": step}, ["main"])
        led.release_member("w")
        # drop the pre-admitted tasks so each round starts from the same place
        store.conn.execute("UPDATE tasks SET status = 'failed' WHERE status = 'queued'")
    assert buf.counts("main")["expired"] == 0


def test_cap_is_s_plus_one_batches_and_counts_inflight(tmp_path: Path) -> None:
    store, led, buf, adm = _setup(tmp_path, 2)
    assert adm.cap("main") == 3 * B
    assert _fill(led, adm) == 3 * B // G
    led.lease("w", 2)
    assert adm.outstanding() == {"main": 3 * B}  # leased tasks count as their expected sequences
    assert adm.outstanding_groups() == {"main": 3 * B // G}
    assert _fill(led, adm) == 0
    assert adm.may_lease({"main": 0}, ["main"])
    store.record_version("main", 3, 3, "")
    need = 3 + adm.ahead("main") // B - 2  # in-flight work ahead pushes the required version up
    assert adm.ahead("main") == 2 * G
    assert adm.may_lease({"main": need}, ["main"]) and not adm.may_lease({"main": need - 1}, ["main"])
    assert not adm.may_lease({}, ["main"])


def test_multi_policy_task_needs_room_in_every_policy(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    adm = Admission(store, {"a": PolicyLimits(4, 0), "b": PolicyLimits(8, 0)})
    led = Ledger(store)
    roles = {"solver": "a", "verifier": "b"}
    assert Admission.sequences_per_task(roles, 2) == {"a": 2, "b": 2}
    # a has room for 2 tasks (cap 4 sequences), b for 4: the first two feed both, the next two only b
    assert adm.plan(roles, 2) == [["a", "b"], ["a", "b"], ["b"], ["b"]]
    for _ in range(2):
        led.enqueue("k", {}, roles, 2)
    assert adm.plan(roles, 2) == [["b"], ["b"]]
    for _ in range(2):
        led.enqueue("k", {}, roles, 2, read_only=["a"])  # a's output of these is not kept
    assert adm.outstanding() == {"a": 4, "b": 8}
    assert adm.tasks_to_admit(roles, 2) == 0


def test_room_is_what_plan_would_feed_each_policy(tmp_path: Path) -> None:
    # the admission room the live controller reports in status.demand
    store = Store.open(tmp_path / "s.db")
    adm = Admission(store, {"a": PolicyLimits(4, 0), "b": PolicyLimits(8, 0)})
    roles = {"solver": "a", "verifier": "b"}
    assert adm.room(roles, 2) == {"a": 2, "b": 4}
    Ledger(store).enqueue("k", {}, roles, 2)
    assert adm.room(roles, 2) == {"a": 1, "b": 3}


def test_cap_not_a_multiple_of_the_group_never_overshoots(tmp_path: Path) -> None:
    """Replay makes a batch's fresh part odd (64 - 19 = 45 with groups of 8): whole tasks only up to the cap."""
    store = Store.open(tmp_path / "s.db")
    store.ensure_policy("main", 1)
    led = Ledger(store)
    adm = Admission(store, {"main": PolicyLimits(45, 1)})
    n = adm.tasks_to_admit(ROLES, 8)
    assert n == 90 // 8 == 11  # 88 sequences <= (1 + 1) * 45; 12 tasks would be 96
    for i in range(n):
        led.enqueue(f"k{i}", {}, ROLES, 8)
    assert adm.outstanding()["main"] <= adm.cap("main")
    assert adm.tasks_to_admit(ROLES, 8) == 0


def test_a_cap_smaller_than_one_group_still_makes_progress(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    store.ensure_policy("main", 0)
    adm = Admission(store, {"main": PolicyLimits(4, 0)})
    assert adm.tasks_to_admit(ROLES, 8) == 1  # nothing outstanding: one task goes anyway
    Ledger(store).enqueue("k", {}, ROLES, 8)
    assert adm.tasks_to_admit(ROLES, 8) == 0


def test_lease_counts_the_whole_task_against_the_bound(tmp_path: Path) -> None:
    """B = 45 fresh sequences, groups of 8, S = 1: with 88 sequences ahead, a task of 8 would put its last
    sequences 96 deep, i.e. two versions out; it needs weights one version newer than with 40 ahead."""
    store = Store.open(tmp_path / "s.db")
    store.ensure_policy("main", 1)
    led = Ledger(store)
    adm = Admission(store, {"main": PolicyLimits(45, 1)})
    for i in range(11):
        led.enqueue(f"k{i}", {}, ROLES, 8)
    led.lease("w", 11)  # 88 sequences in flight
    assert adm.ahead("main") == 88
    assert adm.may_lease({"main": 1}, ["main"], {"main": 8})  # target 0: 0 + (88 + 7) // 45 - 1 = 1
    assert not adm.may_lease({"main": 0}, ["main"], {"main": 8})
    assert adm.may_lease({"main": 0}, ["main"], {"main": 2})  # a small task still fits two batches deep


def _two(tmp_path: Path, **kw: object) -> tuple[Store, Ledger, Buffer, Admission]:
    store = Store.open(tmp_path / "s.db")
    for p in ("a", "b", "frozen"):
        store.ensure_policy(p, 0)
    limits = {
        "a": PolicyLimits(4, 0, budget=2),
        "b": PolicyLimits(8, 0, budget=5),
        "frozen": PolicyLimits(2, 0, trainable=False),
    }
    return store, Ledger(store), Buffer(store), Admission(store, limits, **kw)  # type: ignore[arg-type]


ROLES3 = {"proposer": "a", "solver": "b", "judge": "frozen"}


def _take(store: Store, policy: str, step: int) -> None:
    store.conn.execute(
        "INSERT INTO batches (policy, step, traj_ids, replay, version, created) VALUES (?, ?, '[]', '[]', 0, 0)",
        (policy, step),
    )


def test_frozen_and_finished_policies_never_hold_admission(tmp_path: Path) -> None:
    store, led, _buf, adm = _two(tmp_path)
    assert adm.active(ROLES3.values()) == ["a", "b"] and adm.read_only(ROLES3.values()) == ["frozen"]
    assert len(adm.plan(ROLES3, 2)) == 4  # the frozen policy's tiny cap does not bind
    assert adm.may_lease({"a": 0, "b": 0}, ["a", "b", "frozen"])  # its version is never required
    _take(store, "a", 1)
    _take(store, "a", 2)  # a took its budget's last batch: it is finished, b goes on alone
    assert adm.finished("a") and adm.active(ROLES3.values()) == ["b"]
    assert adm.plan(ROLES3, 2) == [["b"]] * 4
    stop = Admission(store, adm.limits, after_budget="stop")
    assert stop.plan(ROLES3, 2) == []  # the recipe says: no more tasks once a policy of the workflow is done


def test_sync_mode_admits_whole_rounds_in_lock_step(tmp_path: Path) -> None:
    store, led, buf, adm = _two(tmp_path, mode="sync")
    round1 = adm.plan(ROLES3, 2)
    # b needs 4 tasks of 2 for its batch of 8, a only 2 for its 4: a is read-only in the rest (one batch a round)
    assert round1 == [["a", "b"]] * 2 + [["b"]] * 2
    for feeds in round1:
        led.enqueue("k", {}, ROLES3, 2, [p for p in ("a", "frozen") if p not in feeds])
    assert adm.plan(ROLES3, 2) == []  # the round is in flight
    for t in led.lease("w", 10):
        led.complete(t.id, t.epoch, "w")
        for pol in ("a", "b"):
            if pol in t.read_only:
                continue
            seq = Sequence(
                policy=pol,
                tokens=[1, 2],
                loss_mask=[0, 1],
                logprobs=[0.0, -1.0],
                versions=[-1, 0],
                sampling=SamplingParams(),
            )
            buf.insert(t.id, t.prompt_key, [seq] * 2, [0.0] * 2)
    assert adm.outstanding() == {"a": 4, "b": 8, "frozen": 0}  # exactly one batch each
    assert adm.plan(ROLES3, 2) == []  # both hold a full batch they have not taken
    assert buf.next_batch("a", 1, 4, 0, 0) is not None and buf.next_batch("b", 1, 8, 0, 0) is not None
    assert adm.plan(ROLES3, 2) == []  # taken, but not yet published
    assert not adm.may_lease({"a": 0, "b": 0}, ["a", "b"])
    store.record_version("a", 1, 1, "")
    assert adm.plan(ROLES3, 2) == []  # b has not published: lock-step
    store.record_version("b", 1, 1, "")
    assert adm.may_lease({"a": 1, "b": 1}, ["a", "b"]) and not adm.may_lease({"a": 1, "b": 0}, ["a", "b"])
    assert adm.plan(ROLES3, 2) == [["a", "b"]] * 2 + [["b"]] * 2  # nothing left over: the next round
    _take(store, "a", 2)  # a's last budgeted step: a is finished
    assert adm.plan(ROLES3, 2) == [["b"]] * 4  # the next round feeds b alone


def test_one_lease_call_counts_ahead_once_and_advances_it_per_task(tmp_path: Path) -> None:
    store, led, buf, adm = _setup(tmp_path, 2)
    for i in range(6):
        led.enqueue(f"k{i}", {}, ROLES, G, read_only=["main"] if i == 3 else [])
    _finish(led, buf, "a", 0)  # 6 tasks buffered, 5 of them feeding main
    for i in range(6):
        led.enqueue(f"q{i}", {}, ROLES, G, read_only=["main"] if i == 1 else [])
    fresh = adm.ahead("main")
    seen: list[tuple[int, int]] = []
    calls = 0
    count = adm._sequences

    def counting(statuses: tuple[str, ...]) -> dict[str, int]:
        nonlocal calls
        calls += 1
        return count(statuses)

    adm._sequences = counting  # type: ignore[method-assign]
    with adm.leasing():

        def accept(t: Any) -> bool:
            # the call's leases are written when it ends: the store still counts none of them
            seen.append((adm.ahead("main"), Admission(store, adm.limits).ahead("main")))
            adm.leased(t.roles, t.group_size, t.read_only)
            return True

        assert len(led.lease("b", 5, accept=accept)) == 5
    assert calls == 1 and seen[0][0] == fresh
    assert [a for a, _ in seen] == [fresh, fresh + G, fresh + G, fresh + 2 * G, fresh + 3 * G]
    assert [b for _, b in seen] == [fresh] * 5
    # outside a lease call: counted from the store again, which now holds the call's leases
    assert adm.ahead("main") == Admission(store, adm.limits).ahead("main") == fresh + 4 * G


def test_leases_made_before_ahead_is_first_counted_are_added_to_it(tmp_path: Path) -> None:
    store, led, _buf, adm = _setup(tmp_path, 2)
    for i in range(3):
        led.enqueue(f"k{i}", {}, ROLES, G)
    fresh = adm.ahead("main")
    with adm.leasing():
        seen: list[int] = []

        def accept(t: Any) -> bool:
            if t.id != 1:  # the first task is leased before anything asks for the count
                seen.append(adm.ahead("main"))
            adm.leased(t.roles, t.group_size, t.read_only)
            return True

        assert len(led.lease("b", 3, accept=accept)) == 3
    assert seen == [fresh + G, fresh + 2 * G]
    assert adm.ahead("main") == fresh + 3 * G

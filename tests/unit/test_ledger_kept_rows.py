"""The leased tasks a ledger keeps as rows (state/ledger.py `_leased`): after every write of a random
run of leases, completions, failures, give-backs, expiries, renewals, read-only changes and
rolled-back writes, `get_many` gives exactly the rows state.db holds; and the rows of tasks just
leased are handed out without a read of the store. Real SQLite."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from astraflow.state.ledger import Ledger, TaskRow, _row
from astraflow.state.store import Store


def _stored(store: Store, ids: list[int]) -> dict[int, TaskRow]:
    marks = ",".join("?" * len(ids))
    return {
        int(r["id"]): _row(r) for r in store.query(f"SELECT * FROM tasks WHERE id IN ({marks})", tuple(ids))
    }


class _Run:
    """A random run of the ledger's writes, one method an operation (each may do nothing)."""

    def __init__(self, store: Store, seed: int) -> None:
        self.rng = random.Random(seed)
        self.store = store
        self.clock = [1000.0]
        self.ledger = Ledger(store, lease_timeout_s=10.0, max_attempts=3, clock=lambda: self.clock[0])
        self.ids = [self.ledger.enqueue(f"p{k}", {"k": k}, {"solver": "main"}, 4) for k in range(40)]
        self.held: dict[str, list[tuple[int, int]]] = {m: [] for m in ("a", "b", "c")}
        self.done = 0

    def some(self, m: str) -> list[tuple[int, int]]:
        got = self.rng.sample(self.held[m], self.rng.randint(0, len(self.held[m])))
        # now and then a stale epoch
        return [(t, e + 1 if self.rng.random() < 0.1 else e) for t, e in got]

    def one(self, m: str) -> tuple[int, int]:
        return self.rng.choice(self.held[m])

    def lease(self, m: str) -> None:
        leased = self.ledger.lease(m, self.rng.randint(1, 5))
        self.held[m] += [(t.id, t.epoch) for t in leased]

    def complete_many(self, m: str) -> None:
        picked = self.some(m)
        # now and then another member's result
        owners = [self.rng.choice(list(self.held)) if self.rng.random() < 0.1 else m for _ in picked]
        self.done += self.ledger.complete_many(picked, owners).count("accepted")

    def complete(self, m: str) -> None:
        tid, epoch = self.one(m)
        self.done += self.ledger.complete(tid, epoch, m) == "accepted"

    def fail(self, m: str) -> None:
        tid, epoch = self.one(m)
        self.ledger.fail(tid, epoch, m, "boom")

    def give_back(self, m: str) -> None:
        tid, epoch = self.one(m)
        self.ledger.give_back(tid, epoch, m)

    def lapsed(self, m: str) -> None:
        self.clock[0] += self.rng.choice([0.0, 11.0])  # past the lease timeout: the member's leases lapse
        self.ledger.give_back_lapsed(m, self.clock[0])

    def release(self, m: str) -> None:
        self.ledger.release_member(m)

    def expire(self, m: str) -> None:
        self.ledger.expire(self.clock[0])

    def renew(self, m: str) -> None:
        self.ledger.renew(m, self.clock[0])

    def renew_tasks(self, m: str) -> None:
        self.clock[0] += 1.0  # a later expiry than the lease's
        ids = [t for t, _ in self.some(m)]
        self.ledger.renew_tasks(m, ids, self.clock[0], max_age_s=self.rng.choice([0.0, 5.0]))

    def read_only(self, m: str) -> None:
        tid = self.one(m)[0]
        # the kept row itself (as the lease's caller holds it), or a row read apart
        task = self.ledger.get_many([tid])[tid] if self.rng.random() < 0.5 else self.ledger.get(tid)
        assert task is not None
        self.ledger.set_read_only(task, [*task.read_only, self.rng.choice(["x", "y"])])

    def rollback(self, m: str) -> None:
        with pytest.raises(RuntimeError), self.store.write():
            self.ledger.complete_many(self.some(m), m)
            self.ledger.lease(m, 2)
            raise RuntimeError("abort")

    def enqueue(self, m: str) -> None:
        self.ids.append(self.ledger.enqueue(f"q{len(self.ids)}", {"k": len(self.ids)}, {"solver": "main"}, 4))

    def tick(self, m: str) -> None:
        self.clock[0] += self.rng.choice([1.0, 6.0, 12.0])


NEEDS_HELD = {"complete_many", "complete", "fail", "give_back", "renew_tasks", "read_only", "rollback"}
OPS = [
    "lease", "lease", "lease", "complete_many", "complete", "fail", "give_back", "lapsed", "release",
    "expire", "renew", "renew_tasks", "read_only", "rollback", "enqueue", "tick",
]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kept_rows_equal_the_store_after_every_write(tmp_path: Path, seed: int) -> None:
    store = Store.open(tmp_path / "state.db")
    run = _Run(store, seed)
    for _ in range(300):
        op, m = run.rng.choice(OPS), run.rng.choice(list(run.held))
        if op in NEEDS_HELD and not run.held[m]:
            continue
        getattr(run, op)(m)
        assert run.ledger.get_many(run.ids) == _stored(store, run.ids), op
    assert run.done > 10  # the run completed tasks, not only refused them
    store.close()


def test_tasks_just_leased_are_handed_out_without_a_read(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    ledger = Ledger(store)
    for k in range(8):
        ledger.enqueue(f"p{k}", {"k": k}, {"solver": "main"}, 4)
    leased = ledger.lease("a", 5)
    # a heartbeat's renewal of the tasks it works on (as every working member's beat does) keeps them
    assert ledger.renew_tasks("a", [t.id for t in leased], max_age_s=600.0) == 5
    stored = [ledger.get(t.id) for t in leased]  # as state.db holds them now
    reads: list[str] = []
    store.conn.set_trace_callback(lambda q: reads.append(q) if "FROM tasks" in q else None)
    got = ledger.get_many([t.id for t in leased] + [8])  # one not leased: read from the store
    store.conn.set_trace_callback(None)
    assert [got[t.id] for t in leased] == stored and got[8].status == "queued"
    assert len(reads) == 1 and "8" in reads[0]
    store.close()


def test_a_task_with_a_long_sample_is_read_again(tmp_path: Path) -> None:
    from astraflow.state.ledger import KEPT_SAMPLE_CHARS

    store = Store.open(tmp_path / "state.db")
    ledger = Ledger(store)
    short = ledger.enqueue("p0", {"k": 0}, {"solver": "main"}, 4)
    long = ledger.enqueue("p1", {"text": "x" * KEPT_SAMPLE_CHARS}, {"solver": "main"}, 4)
    leased = ledger.lease("a", 2)
    assert (
        [t.id for t in leased] == [short, long] and leased[0].sample == {"k": 0} and leased[1].sample["text"]
    )
    reads: list[str] = []
    store.conn.set_trace_callback(lambda q: reads.append(q) if "FROM tasks" in q else None)
    got = ledger.get_many([short, long])
    store.conn.set_trace_callback(None)
    assert got == {t.id: t for t in leased}
    # the long one only is read; the kept short one holds no parsed sample of its own
    assert len(reads) == 1 and f"({long})" in reads[0]
    assert "sample" not in vars(got[short])
    store.close()

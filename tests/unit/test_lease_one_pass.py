"""A lease call's per-task work done once: the open tasks per shape read with one GROUP BY and then
kept by the ledger's writes across calls (state/open_shapes.py), the lease rule as bounds per task shape
(`Admission.lease_bounds`), samples parsed by msgspec as json.loads parses them (`sample_of`);
checked against what they replace, on a real Controller and state.db driven without sockets."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from astraflow.bench import control_inproc as inproc
from astraflow.dataflow.admission import Admission, PolicyLimits
from astraflow.protocol import messages as m
from astraflow.state import open_shapes
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store
from astraflow.state.task_json import sample_of
from tests.dispatch_controller import traced


def _stored_shapes(store: Store) -> dict[tuple[str, str, int, str], int]:
    rows = store.conn.execute(
        "SELECT status, roles, group_size, read_only, COUNT(*) FROM tasks AS checked "
        "WHERE status IN ('queued', 'leased') GROUP BY status, roles, group_size, read_only"
    ).fetchall()
    return {(r[0], r[1], int(r[2]), r[3]): int(r[4]) for r in rows}


class _Checked(inproc._Driver):
    """The bench's driver: after each write of the ledger that keeps the counts (queueing, leasing,
    completing), the kept counts equal what state.db counts; the statements of each task request
    are recorded."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.checks = 0
        self.statements: list[list[str]] = []
        ledger = self.ctl.ledger
        for name in ("lease", "enqueue_many", "complete_many", "complete"):
            setattr(ledger, name, self._checking(getattr(ledger, name)))

    def _checking(self, write: Any) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            out = write(*args, **kwargs)
            shapes = self.ctl.ledger.shapes
            if shapes.counts is not None:
                assert shapes.counts == _stored_shapes(self.ctl.store)
                self.checks += 1
            return out

        return checked

    def send(self, ident: str, msg: m.Msg) -> list[m.Msg]:
        with traced(self.ctl.store) as seen:
            replies = super().send(ident, msg)
        if isinstance(msg, m.TaskRequest):
            self.statements.append(seen)
        assert open_shapes.kept_for(self.ctl.store, open_shapes.OPEN) is None  # no span outlives its call
        return replies


def test_kept_shapes_match_the_store_and_are_read_once_a_run(tmp_path: Path) -> None:
    d = _Checked(tmp_path)
    inproc.join(d)
    inproc.run_steps(d, 1, 4, random.Random(0), 3)
    assert d.checks > 10  # refills, leases and results, each compared
    leasing = [s for s in d.statements if any("status = 'queued' AND id >" in q for q in s)]
    refilling = [s for s in leasing if any(q.startswith("INSERT INTO tasks") for q in s)]
    assert refilling  # requests that queued tasks, then leased them
    # the production cap, the queue's shapes and the work ahead: the first request reads one GROUP BY
    # of the open tasks, and results keep the counts, so no later request reads it again
    reads = [sum("GROUP BY" in q and "FROM tasks WHERE" in q for q in s) for s in d.statements]
    assert reads[0] == 1 and sum(reads) == 1, reads
    d.ctl.store.close()


def test_counts_dropped_by_a_change_they_do_not_follow_are_read_again(tmp_path: Path) -> None:
    d = _Checked(tmp_path)
    inproc.join(d)
    inproc.run_steps(d, 1, 2, random.Random(0), 3)
    ledger = d.ctl.ledger
    assert ledger.shapes.counts is not None
    grant = d.send(inproc.WORKERS[0], m.TaskRequest(n=2, loaded={inproc.POLICY: 1}, wait_s=0.0))[0]
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 2
    # a lease given back: the counts cannot follow it, the next request reads the store
    assert ledger.give_back(grant.tasks[0].task_id, grant.tasks[0].epoch, inproc.WORKERS[0])
    assert ledger.shapes.counts is None
    before = len(d.statements)
    d.send(inproc.WORKERS[1], m.TaskRequest(n=1, loaded={inproc.POLICY: 1}, wait_s=0.0))
    assert sum("GROUP BY" in q and "FROM tasks WHERE" in q for q in d.statements[before]) == 1
    assert ledger.shapes.counts == _stored_shapes(d.ctl.store)
    d.ctl.store.close()


class _Fixed(Admission):
    """Admission with its targets and the work ahead given."""

    def __init__(self, limits: dict[str, PolicyLimits], mode: str, target: dict[str, int]) -> None:
        super().__init__(None, limits, mode=mode)  # type: ignore[arg-type]
        self.target = target
        self.now_ahead: dict[str, int] = {}

    def taken(self, policy: str) -> int:
        return self.target[policy]

    def published(self, policy: str) -> int:
        return self.target[policy]

    def ahead(self, policy: str) -> int:
        return self.now_ahead.get(policy, 0)


def _rule(adm: Admission, loaded: dict[str, int], feeds: list[str], seqs: dict[str, int] | None) -> bool:
    """The lease rule written out: v >= target + floor((ahead + k - 1) / B) - S for every active
    policy (sync mode: v >= target)."""
    for pol in adm.active(feeds):
        lim = adm.limits[pol]
        need = adm.target_version(pol)
        if adm.mode != "sync":
            k = max(1, (seqs or {}).get(pol, 1))
            need += (adm.ahead(pol) + k - 1) // lim.batch_size - lim.max_staleness
        if loaded.get(pol, 0) < need:
            return False
    return True


def test_lease_bounds_decide_as_may_lease() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(3000):
        pols = ["a", "b", "c"][: rng.randint(1, 3)]
        limits = {
            p: PolicyLimits(
                rng.randint(1, 40), rng.randint(0, 3), rng.choice([None, 0, 5, 50]), rng.random() > 0.1
            )
            for p in pols
        }
        adm = _Fixed(limits, rng.choice(["async", "sync"]), {p: rng.randint(0, 6) for p in pols})
        loaded = {p: rng.randint(0, 8) for p in pols if rng.random() > 0.2}
        feeds = rng.sample(pols, rng.randint(1, len(pols)))
        seqs = {p: rng.randint(0, 20) for p in feeds} if rng.random() > 0.2 else None
        bounds = adm.lease_bounds(loaded, feeds, seqs)
        for _ in range(5):
            adm.now_ahead = {p: rng.randint(0, 200) for p in pols}
            by_bounds = bounds is not None and all(adm.ahead(p) <= most for p, most in bounds)
            want = _rule(adm, loaded, feeds, seqs)
            assert by_bounds == want == adm.may_lease(loaded, feeds, seqs), (
                limits,
                adm.mode,
                loaded,
                feeds,
                seqs,
            )
            checked += by_bounds
    assert checked > 1000  # both answers seen often


def test_samples_parse_as_json_loads_parses_them(tmp_path: Path) -> None:
    rng = random.Random(3)
    odd = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 2**70, -(2**80), "\ud800", "é\u2028\x00", "😀"]
    for i in range(2000):
        sample: dict[str, Any] = {
            "id": f"t-{i}",
            "x": rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-300, 300),
            "n": rng.randint(-(2**70), 2**70),
            "odd": rng.choice(odd),
            "nested": {"b": [rng.random(), None, True, "s"], "a": {"z": rng.choice(odd)}},
        }
        text = json.dumps(sample, sort_keys=True)
        assert repr(sample_of(text)) == repr(json.loads(text))
    # through the ledger: a leased task's sample is the stored one parsed
    store = Store.open(tmp_path / "state.db")
    ledger = Ledger(store)
    sample = {"key": "k", "prompt": "2 + 2 =", "v": [1.5, math.nan, "\ud83d"]}
    ledger.enqueue_many([("k", sample, [])], {"actor": "main"}, 4)
    (task,) = ledger.lease("w", 1)
    assert repr(task.sample) == repr(json.loads(json.dumps(sample, sort_keys=True)))
    store.close()


def test_a_refill_stores_samples_as_json_dumps_writes_them(tmp_path: Path) -> None:
    rng = random.Random(5)
    odd = [
        math.nan,
        math.inf,
        -0.0,
        2**70,
        "\ud800",
        "é",
        "😀",
        None,
        True,
        (1, 2),
        {"b": 1, "a": [2.5]},
        {3: "k"},
    ]
    samples = [
        {
            "key": f"k{i}",
            "z": rng.choice(odd),
            "a": {"y": rng.random(), "x": rng.choice(odd)},
            "m": [rng.choice(odd)],
        }
        for i in range(300)
    ]
    store = Store.open(tmp_path / "state.db")
    ledger = Ledger(store)
    ledger.enqueue_many([(s["key"], s, []) for s in samples], {"actor": "main"}, 4)
    stored = [r[0] for r in store.conn.execute("SELECT sample FROM tasks ORDER BY id")]
    assert stored == [json.dumps(s, sort_keys=True) for s in samples]
    circular: dict[str, Any] = {"key": "c"}
    circular["self"] = circular
    try:
        ledger.enqueue_many([("ok", {"key": "ok"}, []), ("c", circular, [])], {"actor": "main"}, 4)
    except ValueError as exc:
        assert "Circular reference" in str(exc)
    else:
        raise AssertionError("a circular sample was stored")
    store.close()


def test_a_lease_reads_the_n_asked_for_then_pages_of_lease_page(tmp_path: Path) -> None:
    from astraflow.state.ledger import LEASE_PAGE

    store = Store.open(tmp_path / "state.db")
    ledger = Ledger(store)
    for k in range(200):
        ledger.enqueue(f"p{k}", {"k": k}, {"solver": "main"}, 16)
    limits: list[int] = []
    store.conn.set_trace_callback(
        lambda q: limits.append(int(q.rsplit("LIMIT", 1)[1])) if "status = 'queued' AND id >" in q else None
    )
    # the first 100 queued tasks are refused: the first page is the 2 asked for, every later one
    # LEASE_PAGE rows (not the group size of the last row read)
    leased = ledger.lease("w", 2, accept=lambda t: t.id > 100)
    store.conn.set_trace_callback(None)
    assert [t.id for t in leased] == [101, 102]
    assert (
        limits[0] == 2 and set(limits[1:]) == {LEASE_PAGE} and len(limits) == 1 + math.ceil(100 / LEASE_PAGE)
    )
    store.close()

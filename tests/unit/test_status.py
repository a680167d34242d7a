"""The status document: stable top-level keys and values read from the store."""

from __future__ import annotations

import json
from pathlib import Path

from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.control import RunControl
from astraflow.protocol.messages import SamplingParams, Sequence
from astraflow.state.ledger import Ledger
from astraflow.state.status import build_status
from astraflow.state.store import Store


def test_status_schema_and_values(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    store.init_run("demo", {"run": {"steps": 7}})
    store.ensure_policy("main", 2)
    store.record_version("main", 3, 3, "tcp://w")
    store.add_metrics("main", 3, {"reward_mean": 0.5, "staleness_max": 1.0})
    store.upsert_member("raas-0", "raas", policies=["main"], region="eu", hardware="cpu:2", slots=4)
    store.touch_member("raas-0", 1.0, {"main": 3})
    led = Ledger(store)
    led.enqueue("a", {}, {"actor": "main"}, 1)
    led.enqueue("b", {}, {"actor": "main"}, 1)
    led.lease("raas-0", 1)
    Buffer(store).insert(
        1,
        "a",
        [
            Sequence(
                policy="main",
                tokens=[1],
                loss_mask=[1],
                logprobs=[0.0],
                versions=[3],
                sampling=SamplingParams(),
            )
        ],
        [0.0],
    )
    store.close()
    ro = Store.open_readonly(tmp_path / "state.db")
    doc = build_status(ro)
    json.dumps(doc)  # plain JSON
    assert set(doc) == {
        "schema",
        "run",
        "policies",
        "members",
        "tasks",
        "failures",
        "buffers",
        "stall",
        "control",
        "demand",
    }
    assert doc["failures"] == {"by_reason": {}, "last_error": ""}
    assert doc["run"] == {"name": "demo", "steps": 7, "mode": "async"}
    assert doc["stall"] is None
    assert doc["control"] == {"paused": []}
    (p,) = doc["policies"]
    assert {k: p[k] for k in ("name", "version", "step", "reward_mean", "max_staleness")} == {
        "name": "main",
        "version": 3,
        "step": 3,
        "reward_mean": 0.5,
        "max_staleness": 2,
    }
    assert p["trainable"] and p["budget"] == 7 and not p["finished"] and p["info"] == {}
    (m,) = doc["members"]
    assert {k: m[k] for k in ("id", "role", "status", "policies", "region", "hardware", "loaded")} == {
        "id": "raas-0",
        "role": "raas",
        "status": "alive",
        "policies": ["main"],
        "region": "eu",
        "hardware": "cpu:2",
        "loaded": {"main": 3},
    }
    assert doc["tasks"] == {"queued": 1, "leased": 1, "done": 0, "failed": 0}
    assert doc["buffers"] == {"main": {"buffered": 1, "consumed": 0, "expired": 0, "dropped": 0}}
    assert doc["demand"] == {
        "queued": 1,
        "waiting": 1,
        "leased": 1,
        "raas": 1,
        "slots": 4,
        "busy_slots": 1,
        "idle_fraction": 0.75,
        "workers": [{"id": "raas-0", "slots": 4, "leased": 1, "quarantined": False}],
        "room": None,  # only the live controller knows its admission
        "pace": {"main": None},  # one step row: no pace yet
    }


def test_demand_pace_and_room(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    store.ensure_policy("main", 1)
    for step, t in ((1, 100.0), (2, 110.0), (3, 120.0), (4, 130.0)):
        store.add_metrics("main", step, {"reward_mean": 0.0}, now=t)
    store.upsert_member("raas-0", "raas", policies=[], slots=2)
    store.upsert_member("trainer-main", "trainer", policies=["main"])
    doc = build_status(store, room={"main": 3})
    # 3 steps in 30 s; the trainer is not a worker; no slot leased
    assert doc["demand"]["pace"] == {"main": 6.0}
    assert doc["demand"]["room"] == {"main": 3}
    assert doc["demand"]["idle_fraction"] == 1.0 and doc["demand"]["raas"] == 1


def test_demand_waiting_leaves_out_tasks_of_paused_policies(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    led = Ledger(store)
    led.enqueue("a", {}, {"actor": "main"}, 1)
    led.enqueue("b", {}, {"actor": "main", "critic": "judge"}, 1)
    led.enqueue("c", {}, {"actor": "judge"}, 1)
    led.enqueue("d", {}, {"actor": "main", "critic": "judge"}, 1, read_only=["judge"])
    control = RunControl(store)
    assert build_status(store)["demand"]["waiting"] == 4
    control.pause("main")
    # a is main's alone, d feeds main only; b still feeds judge, c is judge's
    assert {k: build_status(store)["demand"][k] for k in ("queued", "waiting")} == {"queued": 4, "waiting": 2}
    assert [control.may_lease(f) for f in (["main"], ["main", "judge"], ["judge"], [])] == [
        False,
        True,
        True,
        True,
    ]
    control.pause("")
    assert build_status(store)["demand"]["waiting"] == 0
    control.resume("")
    assert build_status(store)["demand"]["waiting"] == 4


def test_status_of_empty_store(tmp_path: Path) -> None:
    doc = build_status(Store.open(tmp_path / "state.db"))
    assert (
        doc["policies"] == []
        and doc["members"] == []
        and doc["run"] == {"name": "", "steps": 0, "mode": "async"}
    )
    assert doc["tasks"] == {"queued": 0, "leased": 0, "done": 0, "failed": 0}

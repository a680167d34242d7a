"""Operator controls through Controller.handle on a real state.db: who may pause, resume, drain and stop
(an operator key only, when keys are on), and what each does to admission, leases and the run's end.
The same refusals over real CURVE sockets are in tests/integration/test_dash_control.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.state.status import build_status
from astraflow.state.store import Store
from astraflow.transport.principal import Principal


def _recipe(model: Path) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "control", "steps": 3},
            "policy": [{"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1}],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"slots": 2},
        }
    )


@pytest.fixture()
def ctl(tiny_model: Path, tmp_path: Path) -> Controller:
    store = Store.open(tmp_path / "state.db")
    c = Controller(_recipe(tiny_model), tmp_path, store)
    c.start()
    return c


def ask(c: Controller, ident: str, msg: m.Msg, principal: Principal | None = None) -> m.Msg:
    reply = c.handle(ident.encode(), msg, principal)
    assert reply is not None
    return reply


def join(c: Controller, ident: str) -> None:
    hello = m.Hello(
        member_id=ident, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
    )
    assert isinstance(ask(c, ident, hello), m.Welcome)


def lease(c: Controller, ident: str) -> m.TaskGrant:
    g = ask(c, ident, m.TaskRequest(n=2, loaded={"main": 0}))
    assert isinstance(g, m.TaskGrant), g
    return g


def test_only_an_operator_key_may_pause_drain_or_stop(ctl: Controller) -> None:
    join(ctl, "w")
    for who in (
        Principal(name="w", role="raas"),
        Principal(name="t", role="trainer", policy="main"),
        Principal(name="obs", role="observer"),
    ):
        for msg in (m.Control(action="pause"), m.Control(action="stop"), m.Leave(member_id="w")):
            r = ask(ctl, who.name, msg, who)
            if isinstance(msg, m.Leave) and who.name == "w":
                assert isinstance(r, m.Ack)  # a member may drain itself
                ctl.draining.discard("w")
                continue
            assert isinstance(r, m.Error) and r.code == "not_authorized", (who, msg, r)
    assert not ctl.control.paused and not ctl.control.stopped and not ctl.stopping()
    assert build_status(ctl.store)["control"] == {"paused": []}
    op = Principal(name="ops", role="operator")
    r = ask(ctl, "ops", m.Control(action="pause"), op)
    assert isinstance(r, m.Ack) and "*" in r.detail
    r = ask(ctl, "ops", m.Control(action="jump"), op)
    assert isinstance(r, m.Error) and r.code == "bad_request"
    r = ask(ctl, "ops", m.Control(action="pause", policy="nope"), op)
    assert isinstance(r, m.Error) and r.code == "unknown_policy"
    assert isinstance(ask(ctl, "ops", m.Leave(member_id="w"), op), m.Ack)
    r = ask(ctl, "w", m.TaskRequest(n=1, loaded={"main": 0}))
    assert isinstance(r, m.Error) and r.code == "draining"


def test_pause_holds_admission_and_leases_until_resumed(ctl: Controller, tiny_model: Path) -> None:
    join(ctl, "w")
    for policy in ("", "main"):
        assert isinstance(ask(ctl, "cli", m.Control(action="pause", policy=policy)), m.Ack)
        queued = ctl.store.scalar("SELECT COUNT(*) FROM tasks")
        assert lease(ctl, "w").tasks == []  # queued tasks of a paused policy wait
        ctl.refill()
        assert ctl.store.scalar("SELECT COUNT(*) FROM tasks") == queued  # nothing new admitted
        assert build_status(ctl.store)["control"]["paused"] == [policy or "*"]
        # a restarted controller keeps the pause
        again = Controller(_recipe(tiny_model), ctl.run_dir, ctl.store)
        assert again.control.is_paused("main")
        ctl.tick(ctl.progress.last + 10_000)  # a paused run is not a stall
        assert ctl.loop.exit_code == 0 and not ctl.loop.stop_requested
        join(ctl, "w")  # that far-off tick declared the worker dead
        assert isinstance(ask(ctl, "cli", m.Control(action="resume", policy=policy)), m.Ack)
        grant = lease(ctl, "w")
        assert grant.tasks, "resumed: tasks are leased again"
        for t in grant.tasks:
            ask(ctl, "w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, error="give back"))
    events = [e["kind"] for e in ctl.store.events(limit=50)]
    assert events.count("admission_paused") == 2 and events.count("admission_resumed") == 2


def test_stop_ends_the_run_cleanly(ctl: Controller) -> None:
    join(ctl, "w")
    ask(ctl, "cli", m.Control(action="pause", policy="main"))
    r = ask(ctl, "cli", m.Control(action="stop"))
    assert isinstance(r, m.Ack) and r.detail == "stopping"
    assert lease(ctl, "w").stop
    hb = ask(ctl, "w", m.Heartbeat(loaded={"main": 0}))
    assert isinstance(hb, m.HeartbeatAck) and hb.stop
    ctl.tick()
    assert ctl.finished_at is not None and not ctl.finished()  # ended before its budget
    # the trainer's next batch request is answered done: it checkpoints and exits 0
    t = m.Hello(
        member_id="t", role="trainer", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=2, host="h"
    )
    assert isinstance(ask(ctl, "t", t), m.Welcome)
    b = ask(ctl, "t", m.BatchRequest(policy="main", step=1))
    assert isinstance(b, m.BatchReply) and b.done
    # the next start continues the run, unpaused
    assert build_status(ctl.store)["control"] == {"paused": []}

"""Long polls (roles/controller/long_polls.py, parked.py), driven through Controller.dispatch on a real
state.db (no sockets): a held request gets no reply until the event that changes its answer, then
exactly one."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.roles.controller.outcome import Event
from astraflow.state.store import Store


def _controller(model: Path, tmp_path: Path) -> Controller:
    recipe = Recipe.model_validate(
        {
            "run": {"name": "polls", "steps": 3},
            "policy": [{"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1}],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"slots": 4},
        }
    )
    c = Controller(recipe, tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    return c


def _hello(ident: str, role: str) -> m.Hello:
    return m.Hello(
        member_id=ident, role=role, protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
    )


def _episodes() -> list[m.Episode]:
    seq = m.Sequence(
        policy="main",
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.5],
        versions=[-1, 0, 0],
        reward=1.0,
        sampling=m.SamplingParams(),
    )
    return [m.Episode(sequences=[seq]) for _ in range(2)]


def _to(replies: list[tuple[bytes, m.Msg]], ident: str) -> list[m.Msg]:
    return [r for to, r in replies if to == ident.encode()]


def test_held_requests_are_answered_by_the_event_that_changes_them(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    for ident, role in (("trainer-main", "trainer"), ("w", "raas")):
        assert isinstance(_to(c.dispatch(ident.encode(), _hello(ident, role)), ident)[0], m.Welcome)
    # the trainer asks before any rollout: held, no reply
    assert c.dispatch(b"trainer-main", m.BatchRequest(policy="main", step=1, wait_s=1.0)) == []
    # the worker fills the cap ((S + 1) x B = 2 tasks); its next request is held too
    grant = _to(c.dispatch(b"w", m.TaskRequest(n=4, loaded={"main": 0}, wait_s=1.0)), "w")[0]
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 2
    assert c.dispatch(b"w", m.TaskRequest(n=2, loaded={"main": 0}, wait_s=1.0)) == []
    # the first result makes the batch ready: the held BatchRequest is answered with it, at once
    t = grant.tasks[0]
    out = c.dispatch(b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=_episodes()))
    acks, batches = _to(out, "w"), _to(out, "trainer-main")
    assert [type(a) for a in acks] == [m.ResultAck]
    assert len(batches) == 1 and isinstance(batches[0], m.BatchReply) and batches[0].ready
    assert len(batches[0].samples) == 2
    # taking the batch made room, but the worker's loaded version 0 is too old for it: still held
    assert len(c.parked.tasks) == 1
    # a recorded version answers the held TaskRequest at once (the worker must hear of it to pull it)
    pub = m.VersionPublished(policy="main", version=1, step=1, weights_addr="tcp://127.0.0.1:1")
    out = c.dispatch(b"trainer-main", pub)
    assert isinstance(_to(out, "trainer-main")[0], m.Ack)
    held = _to(out, "w")
    assert len(held) == 1 and isinstance(held[0], m.TaskGrant)
    assert [v.version for v in held[0].versions] == [1]
    # a request still held at its deadline gets the plain answer then, once
    assert c.dispatch(b"trainer-main", m.BatchRequest(policy="main", step=2, wait_s=0.5)) == []
    assert c.wake(("batch",), time.time(), expired_only=True) == []
    late = c.wake(("batch",), time.time() + 1.0, expired_only=True)
    assert len(late) == 1 and isinstance(late[0][1], m.BatchReply) and not late[0][1].ready
    assert len(c.parked) == 0


def test_heartbeats_learn_which_requests_were_lost_and_a_rejoin_voids_held_ones(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A heartbeat's `waiting` rids: held ones are not lost, unknown ones are. A member that joins
    again (its client already failed what it had in flight) has nothing held any more, so no late
    grant goes to a request nobody waits for; the same when it is declared dead or says Bye."""
    c = _controller(tiny_model, tmp_path)
    assert isinstance(
        _to(c.dispatch(b"trainer-main", _hello("trainer-main", "trainer")), "trainer-main")[0], m.Welcome
    )
    assert c.dispatch(b"trainer-main", m.BatchRequest(rid=7, policy="main", step=1, wait_s=1.0)) == []
    ack = _to(c.dispatch(b"trainer-main", m.Heartbeat(rid=8, waiting=[7, 5])), "trainer-main")[0]
    assert isinstance(ack, m.HeartbeatAck) and ack.lost == [5]
    # joining again drops the held request: a later event answers nothing for it, heartbeats call it lost
    assert isinstance(
        _to(c.dispatch(b"trainer-main", _hello("trainer-main", "trainer")), "trainer-main")[0], m.Welcome
    )
    assert len(c.parked) == 0
    assert c.wake(("batch",), time.time() + 5.0) == []
    ack = _to(c.dispatch(b"trainer-main", m.Heartbeat(rid=9, waiting=[7])), "trainer-main")[0]
    assert isinstance(ack, m.HeartbeatAck) and ack.lost == [7]
    # declared dead (silent past member_timeout_s): what it held goes too
    assert c.dispatch(b"trainer-main", m.BatchRequest(rid=10, policy="main", step=1, wait_s=1.0)) == []
    assert len(c.parked) == 1
    c.tick(time.time() + c.recipe.controller.member_timeout_s + 60)
    assert len(c.parked) == 0


def test_a_stop_answers_every_held_request_at_once_and_a_refused_control_none(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An operator's stop is an event every held request subscribes to (roles/controller/long_polls.py):
    the held BatchRequest is answered `done` and the held TaskRequest `stop` by the Control's own
    dispatch, before their deadlines; a refused Control changed nothing, so it answers nothing."""
    c = _controller(tiny_model, tmp_path)
    for ident, role in (("trainer-main", "trainer"), ("w", "raas")):
        assert isinstance(_to(c.dispatch(ident.encode(), _hello(ident, role)), ident)[0], m.Welcome)
    assert c.dispatch(b"trainer-main", m.BatchRequest(policy="main", step=1, wait_s=2.0)) == []
    grant = _to(c.dispatch(b"w", m.TaskRequest(n=4, loaded={"main": 0}, wait_s=2.0)), "w")[0]
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 2
    assert c.dispatch(b"w", m.TaskRequest(n=2, loaded={"main": 0}, wait_s=2.0)) == []
    assert len(c.parked) == 2
    out = c.dispatch(b"ops", m.Control(action="jump"))
    assert [(to, type(r)) for to, r in out] == [(b"ops", m.Error)]
    assert len(c.parked) == 2
    out = c.dispatch(b"ops", m.Control(action="stop"))
    assert isinstance(_to(out, "ops")[0], m.Ack)
    (batch,) = _to(out, "trainer-main")
    (held,) = _to(out, "w")
    assert isinstance(batch, m.BatchReply) and batch.done
    assert isinstance(held, m.TaskGrant) and held.stop and not held.tasks
    assert len(c.parked) == 0


def test_a_handler_returns_its_events_and_answers_no_held_request_itself(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Handlers are pure over the state (roles/controller/outcome.py): what they change that a held
    request waits on comes back as events in their Outcome, and only dispatch hands those to the long
    polls. A result handled alone leaves the held BatchRequest held; a Bye names the member whose held
    requests are void."""
    c = _controller(tiny_model, tmp_path)
    for ident, role in (("trainer-main", "trainer"), ("w", "raas")):
        assert isinstance(_to(c.dispatch(ident.encode(), _hello(ident, role)), ident)[0], m.Welcome)
    assert c.dispatch(b"trainer-main", m.BatchRequest(policy="main", step=1, wait_s=1.0)) == []
    grant = _to(c.dispatch(b"w", m.TaskRequest(n=4, loaded={"main": 0})), "w")[0]
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 2
    t = grant.tasks[0]
    done = c.outcome(b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=_episodes()))
    assert isinstance(done.reply, m.ResultAck) and done.reply.status == "accepted"
    assert done.events == (Event.RESULT_ACCEPTED,) and done.void is None
    assert len(c.parked.batches) == 1  # the handler answered nobody: the batch is ready but still held
    # a duplicate causes no event, so dispatching it answers nothing held
    out = c.dispatch(b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=_episodes()))
    assert [(to, r.status) for to, r in out if isinstance(r, m.ResultAck)] == [(b"w", "duplicate")]
    assert len(out) == 1 and len(c.parked.batches) == 1
    served = c.wake(("batch",), time.time())
    assert [(to, type(r), r.ready) for to, r in served if isinstance(r, m.BatchReply)] == [
        (b"trainer-main", m.BatchReply, True)
    ]
    bye = c.outcome(b"w", m.Bye(reason="done"))
    assert isinstance(bye.reply, m.Ack) and bye.events == (Event.RUN_CHANGED,) and bye.void == b"w"


def test_the_heartbeat_handler_takes_the_held_rids_as_data_not_the_held_table(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`members.on_heartbeat` gets the parts it reads and the rids of the member's held requests
    (roles/controller/service.py hands them over): `lost` is the waited-on rids not among them, whatever
    the IO side's table holds. The same through dispatch: the test of heartbeats and lost rids above."""
    from astraflow.roles.controller import members

    c = _controller(tiny_model, tmp_path)
    assert isinstance(
        _to(c.dispatch(b"trainer-main", _hello("trainer-main", "trainer")), "trainer-main")[0], m.Welcome
    )
    member = c.members.row("trainer-main")
    assert member is not None
    done = members.on_heartbeat(
        member,
        m.Heartbeat(waiting=[7, 8, 9]),
        held=(8,),
        store=c.store,
        ledger=c.ledger,
        members=c.members,
        accounting=c.accounting,
        versions=c.policy_versions,
        run=c.run,
        lease_max_age_s=60.0,
    )
    assert isinstance(done.reply, m.HeartbeatAck) and done.reply.lost == [7, 9] and not done.reply.stop
    assert len(c.parked) == 0  # nothing was held: only the rids it was given decided

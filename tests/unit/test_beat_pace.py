"""Idle members beat less often (roles/controller/beat_pace.py): the interval rule, and the per-member
dead timeout through Controller.dispatch and tick on a real state.db (no sockets)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from astraflow.bench.control import recipe
from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.roles.controller.beat_pace import IDLE_MAX_S, BeatPace, idle_interval, timeout_scale
from astraflow.state.store import Store


def test_the_idle_interval_bounds_the_idle_beat_rate() -> None:
    assert idle_interval(2, 0.5, 1000.0) == 0.5  # a small run beats at the recipe's interval
    assert idle_interval(1000, 0.5, 1000.0) == 1.0
    assert idle_interval(10_000, 0.5, 1000.0) == 10.0  # 10,000 members: 1,000 beats a second
    assert idle_interval(10**7, 0.5, 1000.0) == IDLE_MAX_S
    pace = BeatPace(0.5, 1000.0)
    assert pace.update(600) == 0.5  # within CHANGE of what was told: members are not told again
    assert pace.update(1000) == 1.0
    assert pace.update(1200) == 1.0
    assert pace.update(10_000) == 10.0
    assert pace.for_role("raas") == 10.0 and pace.for_role("trainer") == 0.5
    assert pace.update(0) == 0.5


def test_the_timeout_scale_is_the_interval_over_the_recipes_rounded_up_to_a_lane() -> None:
    assert timeout_scale(0.0, 0.5) == 1.0 and timeout_scale(0.2, 0.5) == 1.0
    assert timeout_scale(math.nan, 0.5) == 1.0
    assert 20.0 <= timeout_scale(10.0, 0.5) < 20.0 * 2**0.25
    assert timeout_scale(math.inf, 0.5) == timeout_scale(IDLE_MAX_S, 0.5) < 2 * IDLE_MAX_S / 0.5
    # however many intervals members claim, the table keeps few lanes
    assert len({timeout_scale(0.5 + i / 100, 0.5) for i in range(6000)}) <= 4 * 7 + 1


def _controller(tmp_path: Path, **controller: object) -> Controller:
    r = recipe(0.5, 3)
    r["controller"] = {**r.get("controller", {}), "member_timeout_s": 5.0, **controller}
    c = Controller(Recipe.model_validate(r), tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    for ident in ("w0", "w1"):
        hello = m.Hello(member_id=ident, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1)
        assert isinstance(c.dispatch(ident.encode(), hello)[0][1], m.Welcome)
    return c


def _status(c: Controller) -> dict[str, str]:
    return {row["id"]: row["status"] for row in c.store.members()}


def test_an_idle_member_is_timed_by_its_own_interval(tmp_path: Path) -> None:
    c = _controller(tmp_path, idle_beats_per_s=0.2)  # 2 members: an idle interval of 10 s
    c.tick()
    assert c.pace.told == 10.0
    t = time.time()
    # w0 says its next beat comes in 10 s (idle), w1 beats at the recipe's interval
    (ack,) = [r for _, r in c.dispatch(b"w0", m.Heartbeat(next_beat_s=10.0))]
    assert isinstance(ack, m.HeartbeatAck) and ack.idle_interval_s == 10.0
    c.dispatch(b"w1", m.Heartbeat())
    assert c.members.timeout("w0", 5.0) >= 100.0 and c.members.timeout("w1", 5.0) == 5.0
    c.tick(t + 5.5)  # past member_timeout_s: only w1, which promised a beat every 0.5 s, is dead
    assert _status(c) == {"w0": "alive", "w1": "dead"}
    # silent 8 s, past member_timeout_s but within its own: w0 holds its id, another process under
    # it is refused
    c.members.touch("w0", t - 8.0)
    thief = m.Hello(member_id="w0", role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=2)
    refused = c.dispatch(b"w0", thief)[0][1]
    assert isinstance(refused, m.Error) and refused.code == "member_id_in_use"
    c.tick(t + 60.0)  # six of its own intervals: still within its ten
    assert _status(c)["w0"] == "alive"
    c.tick(t + c.members.timeout("w0", 5.0) + 0.5)  # silent past its own timeout: dead
    assert _status(c)["w0"] == "dead"


def test_a_member_given_a_lease_is_timed_at_the_recipes_interval(tmp_path: Path) -> None:
    c = _controller(tmp_path, idle_beats_per_s=0.2)
    c.tick()
    c.dispatch(b"w0", m.Heartbeat(next_beat_s=10.0))
    assert c.members.timeout("w0", 5.0) > 5.0
    grant = c.dispatch(b"w0", m.TaskRequest(n=1, loaded={"main": 0}))[0][1]
    assert isinstance(grant, m.TaskGrant) and grant.tasks
    assert c.members.timeout("w0", 5.0) == 5.0  # it beats at once now; silent, it dies soon
    # a beat that renews leases is timed at the recipe's interval whatever it claims
    c.dispatch(b"w0", m.Heartbeat(active=[grant.tasks[0].task_id], next_beat_s=10.0))
    assert c.members.timeout("w0", 5.0) == 5.0


@pytest.mark.parametrize("held", [True, False])
def test_an_idle_beat_naming_a_held_long_poll_stays_on_the_fast_path(tmp_path: Path, held: bool) -> None:
    """A worker whose task request the controller holds is idle: its beat is taken from memory; a beat
    naming a request the controller never got takes the general path, which says it is lost."""
    c = _controller(tmp_path)
    c.dispatch(b"w0", m.Heartbeat())  # the first beat after the Hello: the general path
    if held:
        c.parked.park(b"w0", None, m.TaskRequest(rid=77, n=1, loaded={"main": 0}, wait_s=2.0), time.time())
    replies = [r for _, r in c.dispatch(b"w0", m.Heartbeat(waiting=[77], next_beat_s=1.0))]
    if held:
        assert replies == []  # answered from memory: nothing new to say
    else:
        (ack,) = replies
        assert isinstance(ack, m.HeartbeatAck) and ack.lost == [77]


def test_a_slowly_beating_idle_member_is_answered_every_other_beat(tmp_path: Path) -> None:
    """Each answer is a message on the member's connection: a member beating every 10 s hears from
    the controller every 20 s, well inside the four intervals it waits before dialling again."""
    c = _controller(tmp_path, idle_beats_per_s=0.2)
    c.tick()
    beat = m.Heartbeat(next_beat_s=10.0)
    (told,) = [r for _, r in c.dispatch(b"w0", beat)]  # after the Hello: the general path answers
    assert isinstance(told, m.HeartbeatAck) and told.idle_interval_s == 10.0
    t = time.time()
    answered = [len(c.beats.idle(b"w0", beat, None, t + 10.0 * i) or []) for i in range(1, 7)]
    assert answered == [0, 1, 0, 1, 0, 1]
    # one beating every 0.5 s is answered every 2 s (ACK_EVERY_S), as before
    fast = m.Heartbeat()
    c.dispatch(b"w1", fast)
    t = time.time()
    answered = [len(c.beats.idle(b"w1", fast, None, t + 0.5 * i) or []) for i in range(1, 9)]
    assert answered == [0, 0, 0, 1, 0, 0, 0, 1]

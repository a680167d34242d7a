"""A member's heartbeat pace (transport/member_loop.py `interval`): a MemberClient against a ROUTER
that plays the controller on loopback. Idle, it beats at the idle interval the Welcome tells; a lease,
a new error or a request the controller may not hold brings it back to the recipe's interval at once;
an idle member answered at its long interval never dials again, one that hears nothing does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from astraflow.protocol import messages as m
from astraflow.transport import member_loop
from astraflow.transport.client import MemberClient
from tests.loopback_member import member_of, serve_router

FAST = 0.05
IDLE = 0.5


@dataclass
class FakeController:
    """A ROUTER that welcomes, and records (and, while `answer`, acknowledges) every heartbeat."""

    sock: zmq.Socket
    beats: list[tuple[float, m.Heartbeat]] = field(default_factory=list)
    answer: bool = True
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        serve_router(self.sock, self.stop, self.reply)

    def reply(self, msg: m.Msg) -> m.Msg | None:
        if isinstance(msg, m.Hello):
            return m.Welcome(
                rid=msg.rid, run_name="r", sections={}, heartbeat_interval_s=FAST, idle_interval_s=IDLE
            )
        if isinstance(msg, m.Heartbeat):
            self.beats.append((time.monotonic(), msg))
            if self.answer:
                return m.HeartbeatAck(rid=msg.rid)
        return None

    def since(self, t: float) -> list[m.Heartbeat]:
        return [b for at, b in list(self.beats) if at >= t]


@pytest.fixture()
def fake() -> Iterator[tuple[FakeController, MemberClient]]:
    hello = m.Hello(member_id="pace-a", role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"])
    with member_of(FakeController, hello, 1.0) as (ctl, client, welcome):
        assert welcome.idle_interval_s == IDLE and client.idle_interval_s == IDLE
        yield ctl, client


def test_a_member_beats_slowly_while_idle_and_at_once_when_work_arrives(
    fake: tuple[FakeController, MemberClient],
) -> None:
    ctl, client = fake
    time.sleep(0.6)  # past the first beat
    t = time.monotonic()
    time.sleep(1.6)
    idle = ctl.since(t)
    assert 2 <= len(idle) <= 5  # one every 0.5 s, not one every 0.05 s (32)
    assert all(b.next_beat_s == IDLE and not b.active for b in idle)
    # a lease: the next beat goes out at once, not at the end of the idle interval
    got = time.monotonic()
    client.set_progress([7])
    time.sleep(0.6)
    busy = ctl.since(got)
    assert busy and busy[0].active == [7] and ctl.beats[-len(busy)][0] - got < 0.2
    assert len(busy) >= 6 and all(b.next_beat_s == 0.0 for b in busy)
    client.set_progress([])
    time.sleep(0.2)
    t = time.monotonic()
    time.sleep(1.1)
    assert len(ctl.since(t)) <= 3  # idle again
    # a new error is reported at once; the same error again is no reason to beat fast
    got = time.monotonic()
    client.set_progress([], "weights rejected")
    time.sleep(0.2)
    (first, *_) = ctl.since(got)
    assert first.error == "weights rejected" and first.next_beat_s == 0.0
    t = time.monotonic()
    time.sleep(1.1)
    assert len(ctl.since(t)) <= 3
    # a request the controller may not hold (not a long poll) keeps the member at the fast pace; a
    # long poll it holds does not
    pending = client.submit(m.StatusRequest(), timeout_s=5.0)
    time.sleep(0.3)
    t = time.monotonic()
    time.sleep(0.5)
    assert len(ctl.since(t)) >= 5 and all(b.waiting for b in ctl.since(t))
    pending.cancel()


def test_a_long_poll_in_flight_is_idle_and_named_in_every_beat(
    fake: tuple[FakeController, MemberClient],
) -> None:
    ctl, client = fake
    client.submit(m.TaskRequest(n=1, wait_s=2.0), timeout_s=10.0)
    time.sleep(0.3)
    t = time.monotonic()
    time.sleep(1.6)
    beats = ctl.since(t)
    assert 2 <= len(beats) <= 5 and all(b.waiting and b.next_beat_s == IDLE for b in beats)


def test_an_idle_member_answered_at_its_interval_does_not_dial_again(
    fake: tuple[FakeController, MemberClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each beat is answered, one idle interval after the last answer: longer than REOPEN_AFTER_S
    (shrunk here), which is no reason to reconnect; silence for a few intervals is."""
    ctl, client = fake
    reopens: list[float] = []
    real = member_loop.MemberLoop._reopen

    def counted(self: member_loop.MemberLoop) -> None:
        reopens.append(time.monotonic())
        real(self)

    monkeypatch.setattr(member_loop, "REOPEN_AFTER_S", 0.2)
    monkeypatch.setattr(member_loop.MemberLoop, "_reopen", counted)
    time.sleep(2.5)
    assert reopens == []
    ctl.answer = False
    quiet = time.monotonic()
    deadline = quiet + 6.0
    while not reopens and time.monotonic() < deadline:
        time.sleep(0.05)
    # silence past REOPEN_BEATS idle intervals (2 s) since the first beat not answered: it dials again
    assert (
        reopens
        and member_loop.REOPEN_BEATS * IDLE < reopens[0] - quiet < (member_loop.REOPEN_BEATS + 2) * IDLE + 0.5
    )

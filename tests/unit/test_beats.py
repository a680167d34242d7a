"""Heartbeats (roles/controller/beats.py), driven through Controller.dispatch on a real state.db (no
sockets): an idle beat is answered only with news or after ACK_EVERY_S, writes nothing to state.db,
and still passes the rate limit; every other beat takes the general path and is answered."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.bench.control import recipe
from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.roles.controller.beats import ACK_EVERY_S, BURST, NEWS_EVERY_S
from astraflow.roles.member_table import FLUSH_S, SEEN_FLUSH_S
from astraflow.state.store import Store

IDLE = m.Heartbeat(loaded={"main": 0}, busy=0, free=32)


def _controller(tmp_path: Path, members: int = 3) -> Controller:
    c = Controller(Recipe.model_validate(recipe(0.5, members)), tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    for i in range(members):
        ident = f"w{i}"
        hello = m.Hello(member_id=ident, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1)
        assert isinstance(c.dispatch(ident.encode(), hello)[0][1], m.Welcome)
    hello = m.Hello(member_id="trainer-main", role="trainer", protocol=m.PROTOCOL_VERSION, policies=["main"])
    assert isinstance(c.dispatch(b"trainer-main", hello)[0][1], m.Welcome)
    return c


def _beat(c: Controller, ident: str, **kw: object) -> list[m.Msg]:
    beat = m.Heartbeat(**{"loaded": {"main": 0}, "busy": 0, "free": 32, **kw})  # type: ignore[arg-type]
    return [r for to, r in c.dispatch(ident.encode(), beat) if to == ident.encode()]


def test_idle_beats_are_answered_with_news_only_and_at_least_every_ack_interval(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    (first,) = _beat(c, "w0")  # the first beat after the Hello takes the general path: answered
    assert isinstance(first, m.HeartbeatAck) and first.versions == []
    assert _beat(c, "w0") == [] and _beat(c, "w0", busy=1, free=31) == []  # nothing new: no answer
    # a version recorded (what versions.on_version does to the store and the cached versions): every
    # member hears of it at its next beat at least NEWS_EVERY_S after its last answer, once
    with c.store.write():
        c.store.record_version("main", 1, 1, "tcp://127.0.0.1:9", "", 0)
    c.policy_versions.changed()
    t = time.time()
    (news,) = c.beats.idle(b"w0", IDLE, None, t + NEWS_EVERY_S) or [(b"", m.Ack())]
    assert isinstance(news[1], m.HeartbeatAck) and news[1].versions[0].version == 1
    assert c.beats.idle(b"w0", IDLE, None, t + NEWS_EVERY_S + 0.5) == []
    # silence is bounded: once ACK_EVERY_S passed, the next idle beat is answered anyway
    later = t + NEWS_EVERY_S + ACK_EVERY_S
    assert c.beats.idle(b"w0", IDLE, None, later - 0.5) == []
    (due,) = c.beats.idle(b"w0", IDLE, None, later) or [(b"", m.Ack())]
    assert due[0] == b"w0" and isinstance(due[1], m.HeartbeatAck)
    # a stop reaches every beat
    assert isinstance(c.dispatch(b"cli", m.Control(action="stop"))[0][1], m.Ack)
    for _ in range(3):
        (ack,) = _beat(c, "w0")
        assert isinstance(ack, m.HeartbeatAck) and ack.stop


def test_every_beat_that_asks_something_is_answered(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    _beat(c, "w1")
    # requests it waits on that the controller never got: named lost at once
    (lost,) = _beat(c, "w1", waiting=[41, 42])
    assert isinstance(lost, m.HeartbeatAck) and lost.lost == [41, 42]
    # a new error is recorded once (the general path), a repeat of it is idle
    (err,) = _beat(c, "w1", error="weights rejected")
    assert isinstance(err, m.HeartbeatAck)
    assert _beat(c, "w1", error="weights rejected") == []
    events = [e for e in c.store.events(100) if e["kind"] == "member_error"]
    assert len(events) == 1 and "weights rejected" in events[0]["detail"]
    # an id that never joined, and a member declared dead, are refused
    (unknown,) = _beat(c, "nobody")
    assert isinstance(unknown, m.Error) and unknown.code == "unknown_member"
    c.tick(time.time() + 600.0)  # every member silent past member_timeout_s (the bench recipe's 120 s)
    (dead,) = _beat(c, "w1")
    assert isinstance(dead, m.Error) and dead.code == "unknown_member"
    assert b"w1" not in c.beats.beats  # what was kept of its beats went with it


def test_idle_beats_keep_the_rate_limit_and_write_nothing_until_the_flush(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    _beat(c, "w2")
    now = time.time()
    c.tick(now + FLUSH_S)  # what the joins left pending is written now
    before = c.store.conn.total_changes
    replies = [c.beats.idle(b"w2", IDLE, None, now + 0.1) for _ in range(int(2 * BURST))]
    limited = [r for r in replies if r and isinstance(r[0][1], m.Error) and r[0][1].code == "rate_limited"]
    assert int(BURST) <= len(limited) <= int(BURST) + 1  # the first beats took the burst's tokens
    c.tick(now + 2 * FLUSH_S)  # loaded and slots unchanged: last_seen alone waits for SEEN_FLUSH_S
    assert c.store.conn.total_changes == before
    c.tick(now + FLUSH_S + SEEN_FLUSH_S)
    seen = {r["id"]: float(r["last_seen"]) for r in c.store.query("SELECT id, last_seen FROM members")}
    assert seen["w2"] >= now + 0.1 > seen["w0"]


def test_no_member_dies_while_the_controller_is_behind_its_input(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    c.loop.backlogged = True  # the last poll stopped with messages unread
    c.tick(time.time() + 600.0)
    assert len(c.store.members("alive")) == 4
    c.loop.backlogged = False  # read up: the silent ones are dead
    c.tick(time.time() + 600.0)
    assert c.store.members("alive") == []


def test_a_join_writes_its_own_member_not_every_member_heard_from(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    for i in range(3):
        _beat(c, f"w{i}")  # first beats: loaded and slots written at the next flush
    c.tick(time.time() + FLUSH_S)
    for i in range(3):
        c.beats.idle(f"w{i}".encode(), IDLE, None, time.time() + 1.0)  # heard: last_seen waits
    seen = {r["id"]: r["last_seen"] for r in c.store.query("SELECT id, last_seen FROM members")}
    hello = m.Hello(member_id="w9", role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1)
    assert isinstance(c.dispatch(b"w9", hello)[0][1], m.Welcome)
    after = {r["id"]: r["last_seen"] for r in c.store.query("SELECT id, last_seen FROM members")}
    assert {k: after[k] for k in seen} == seen and "w9" in after

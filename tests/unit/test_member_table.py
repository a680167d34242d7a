"""Members in memory (roles/member_table.py), driven through Controller.dispatch and tick on a real
state.db (no sockets): heartbeats write nothing until the periodic flush, and the liveness check
finds the silent members without reading the others."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.roles.member_table import FLUSH_S
from astraflow.state import member_health
from astraflow.state.store import Store

N = 40


def _controller(model: Path, tmp_path: Path) -> Controller:
    recipe = Recipe.model_validate(
        {
            "run": {"name": "members", "steps": 3},
            "policy": [{"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1}],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "controller": {"member_timeout_s": 5.0},
        }
    )
    c = Controller(recipe, tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    for i in range(N):
        ident = f"w{i:02d}"
        hello = m.Hello(
            member_id=ident, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
        )
        assert isinstance(c.dispatch(ident.encode(), hello)[0][1], m.Welcome)
    return c


def _last_seen(c: Controller) -> dict[str, float]:
    return {r["id"]: float(r["last_seen"]) for r in c.store.query("SELECT id, last_seen FROM members")}


def test_heartbeats_write_nothing_until_the_flush(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    c.tick(time.time() + FLUSH_S)  # whatever the joins left pending is written now
    before, seen = c.store.conn.total_changes, _last_seen(c)
    for i in range(N):
        reply = c.dispatch(f"w{i:02d}".encode(), m.Heartbeat(loaded={"main": 3}, busy=1, free=3))[0][1]
        assert isinstance(reply, m.HeartbeatAck)
    assert c.store.conn.total_changes == before and _last_seen(c) == seen
    # a tick before FLUSH_S passed writes nothing either; the one after writes every beat in one go
    c.tick(c.members.last_flush + FLUSH_S / 2)
    assert c.store.conn.total_changes == before
    c.tick(c.members.last_flush + FLUSH_S)
    after = c.store.members("alive")
    assert len(after) == N and all(mem["loaded"] == {"main": 3} and mem["slots"] == 4 for mem in after)
    assert all(_last_seen(c)[mem["id"]] > seen[mem["id"]] for mem in after)
    # a status request sees the newest beats without waiting for the flush
    c.dispatch(b"w00", m.Heartbeat(loaded={"main": 4}))
    status = c.dispatch(b"observer", m.StatusRequest())[0][1]
    assert isinstance(status, m.StatusReply)
    mine = [mem for mem in status.status["members"] if mem["id"] == "w00"][0]
    assert mine["loaded"] == {"main": 4}


def test_only_the_silent_members_die(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    t = time.time() + 10.0  # past member_timeout_s for every member but those heard from then
    for i in range(0, N, 2):
        c.members.touch(f"w{i:02d}", t)
    assert [mid for mid, _ in c.members.silent(t, 5.0)] == [f"w{i:02d}" for i in range(1, N, 2)]
    c.tick(t)
    status = {mem["id"]: mem["status"] for mem in c.store.members()}
    assert status == {f"w{i:02d}": "alive" if i % 2 == 0 else "dead" for i in range(N)}
    # a dead member's heartbeat is refused until it says Hello again
    reply = c.dispatch(b"w01", m.Heartbeat())[0][1]
    assert isinstance(reply, m.Error) and reply.code == "unknown_member"
    events = [e for e in c.store.events(500) if e["kind"] == "member_dead"]
    assert len(events) == N // 2


def test_a_restarted_controller_times_every_alive_member_afresh(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    c.store.close()
    again = Controller(c.recipe, tmp_path, Store.open(tmp_path / "state.db"))
    restarted = time.time()
    again.start()
    assert sorted(again.members.seen) == [f"w{i:02d}" for i in range(N)]
    assert again.members.silent(restarted, 0.0) == []  # every timer starts at the restart or later


def test_migration_0006_indexes_members_for_the_healthy_peer_lookup(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    plan = " ".join(
        str(tuple(r))
        for r in store.query(
            "EXPLAIN QUERY PLAN SELECT id FROM members WHERE status = 'alive' AND role = ? AND quarantined = '' LIMIT 2",
            ("raas",),
        )
    )
    assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, plan
    for i, q in enumerate(("", "too many failures", "")):
        store.upsert_member(f"r{i}", "raas", policies=["main"])
        if q:
            member_health.quarantine(store, f"r{i}", q, time.time() + 60)
    assert member_health.healthy_peer(store, "raas", "r0")
    store.set_member_status("r2", "dead")
    assert not member_health.healthy_peer(store, "raas", "r0")
    assert member_health.healthy_peer(store, "raas", "r1")


def test_messages_use_the_kept_row_and_see_every_change_of_it(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    reads: list[str] = []
    c.store.conn.set_trace_callback(lambda sql: reads.append(sql) if "FROM members WHERE id" in sql else None)
    for _ in range(3):  # asking for none leases nothing: the one task admitted is left for below
        assert isinstance(c.dispatch(b"w00", m.TaskRequest(n=0))[0][1], m.TaskGrant)
    assert len(reads) <= 1  # read once, then kept
    # a quarantine written to the store reaches the next request: no tasks while a peer is healthy
    member_health.quarantine(c.store, "w00", "too many failures", time.time() + 60)
    grant = c.dispatch(b"w00", m.TaskRequest(n=1))[0][1]
    assert isinstance(grant, m.TaskGrant) and grant.tasks == [] and grant.retry_after_s > 0
    member_health.release(c.store, "w00")
    grant = c.dispatch(b"w00", m.TaskRequest(n=1))[0][1]
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 1
    # a member marked dead in the store is refused at once
    c.store.set_member_status("w01", "dead")
    reply = c.dispatch(b"w01", m.TaskRequest(n=1))[0][1]
    assert isinstance(reply, m.Error) and reply.code == "unknown_member"
    # a rolled-back transaction drops every kept row (it may have read what was then undone)
    c.members.row("w02")
    try:
        with c.store.write():
            member_health.quarantine(c.store, "w02", "undone", time.time() + 60)
            assert c.members.row("w02")["quarantined"] == "undone"  # type: ignore[index]
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    assert c.members.row("w02")["quarantined"] == ""  # type: ignore[index]
    c.store.conn.set_trace_callback(None)

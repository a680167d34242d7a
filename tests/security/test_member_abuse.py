"""A member with a valid place in the run that tries to stop or starve it: real controller, RaaS and
trainer processes on loopback; the rogues are raw sockets in this process. An error storm burns no
task and gets its member quarantined, a hoarder holds at most its share of the open tasks while it
heartbeats them, a heartbeat flood with one repeated error writes one event; the run finishes with
every step trained and no task failed. The trainer announces its weight server under --advertise
(a name it cannot bind) on a fixed --weights-port."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import zmq

from astraflow.protocol import messages as m
from tests.chaos.cluster import Cluster, free_port, ro
from tests.security.peers import Peer


def _status(peer: Peer) -> dict[str, dict[str, object]]:
    reply = peer.ask(m.StatusRequest())
    assert isinstance(reply, m.StatusReply)
    return {str(mm["id"]): mm for mm in reply.status["members"]}


def _hoard(peer: Peer, tasks: list[int], stop: threading.Event) -> None:
    """Heartbeat the hoarded leases as in progress, once a second, until stopped."""
    while not stop.wait(1.0):
        peer.ask(m.Heartbeat(loaded={"main": 0}, busy=len(tasks), active=tasks))


@pytest.mark.chaos
@pytest.mark.timeout(600)  # several processes on 2 shared cores
@pytest.mark.skip(
    reason="timing-dependent: on an idle machine the run can end before the storm is quarantined, and a "
    "rogue then waits 20 s for a reply; to be rewritten to wait for events (docs/operations.md, Hostile "
    "members). The accounting itself is covered by tests/unit/test_member_accounting.py"
)
def test_error_storm_hoarding_and_flood_do_not_stop_the_run(tiny_model: Path, tmp_path: Path) -> None:
    steps = 12
    overrides = (
        "policy.batch_prompts=4",
        "policy.group_size=8",
        "rollout.slots=8",
        "controller.max_member_slots=64",
        "controller.quarantine_after=6",
        "rollout.lease_max_age_s=6",
        "rollout.lease_timeout_s=3",
    )
    ctx = zmq.Context()
    stop = threading.Event()
    with Cluster(tmp_path, tiny_model, steps, *overrides) as c:
        ctl = c.controller()
        deadline = time.monotonic() + 120
        while not (c.run_dir / "controller.addr").exists():
            assert ctl.poll() is None and time.monotonic() < deadline, c.log("controller.log")
            time.sleep(0.05)
        watcher = Peer(ctx, c.addr, "watcher")
        worker = c.raas(0)
        # announced as a name (as behind NAT), bound on a fixed port of a local address
        wport = free_port()
        trainer = c.start(
            ["join", "--role", "trainer", "--controller", c.addr, "--policy", "main"]
            + [
                "--checkpoint-dir",
                str(c.checkpoints),
                "--advertise",
                "localhost",
                "--weights-port",
                str(wport),
            ],
            "trainer.log",
        )
        while _status(watcher).get("raas-0", {}).get("status") != "alive":
            assert worker.poll() is None, c.log("raas-0.log")
            time.sleep(0.1)

        # hoarding: one worker asks for everything and heartbeats its leases as in progress
        hoarder = Peer(ctx, c.addr, "hoarder")
        assert isinstance(hoarder.hello("raas", slots=64), m.Welcome)
        grant = hoarder.ask(m.TaskRequest(n=1024, loaded={"main": 0}))
        assert isinstance(grant, m.TaskGrant)
        with ro(c.run_dir) as db:
            open_tasks = db.execute(
                "SELECT COUNT(*) FROM tasks WHERE status IN ('queued','leased')"
            ).fetchone()[0]
        assert 0 < len(grant.tasks) <= (open_tasks + 1) // 2, (len(grant.tasks), open_tasks)
        held = [t.task_id for t in grant.tasks]
        beats = threading.Thread(target=_hoard, args=(hoarder, held, stop), daemon=True)
        beats.start()

        # error storm: every lease answered `error` as fast as it comes, until no more come
        storm = Peer(ctx, c.addr, "storm")
        assert isinstance(storm.hello("raas", slots=64), m.Welcome)
        # heartbeat flood with one 60 KB error again and again: rate-limited, written once
        limited = 0
        for _ in range(300):
            r = storm.ask(m.Heartbeat(loaded={"main": 0}, error="E" * 60_000))
            limited += isinstance(r, m.Error) and r.code == "rate_limited"
        assert limited > 0, limited

        errors, beat = 0, 0.0
        while not _status(watcher)["storm"]["quarantined"]:
            assert time.monotonic() < deadline + 300 and ctl.poll() is None, c.log("controller.log")
            if time.monotonic() - beat > 0.5:  # it stays a live member, as a real one would
                r = storm.ask(m.Heartbeat(loaded={"main": 0}))
                assert isinstance(r, m.HeartbeatAck) or (isinstance(r, m.Error) and r.code == "rate_limited")
                beat = time.monotonic()
            g = storm.ask(m.TaskRequest(n=64, loaded={"main": 0}))
            assert isinstance(g, m.TaskGrant)
            for t in g.tasks:
                r = storm.ask(m.TaskResult(task_id=t.task_id, epoch=t.epoch, error="RuntimeError: no"))
                assert isinstance(r, m.ResultAck)
                errors += 1
            if not g.tasks:
                time.sleep(0.1)
        g = storm.ask(m.TaskRequest(n=64, loaded={"main": 0}))
        assert isinstance(g, m.TaskGrant) and g.tasks == [], "a quarantined member was leased tasks"

        # the hoarded leases, heartbeated as in progress, lapse at rollout.lease_max_age_s all the same
        while True:
            with ro(c.run_dir) as db:
                q = "SELECT COUNT(*) FROM tasks WHERE owner = 'hoarder' AND status = 'leased'"
                if db.execute(q).fetchone()[0] == 0:
                    break
            assert ctl.poll() is None, "the run ended while the hoarder still held its leases"
            time.sleep(0.2)
        stop.set()
        beats.join(timeout=30)

        assert trainer.wait(timeout=400) == 0, c.log("trainer.log")
        assert ctl.wait(timeout=60) == 0, c.log("controller.log")
        assert worker.wait(timeout=60) == 0, c.log("raas-0.log")
        for p in (watcher, hoarder, storm):
            p.close()
    ctx.destroy(linger=0)

    with ro(c.run_dir) as db:
        versions = [r[0] for r in db.execute("SELECT version FROM versions ORDER BY version")]
        addrs = {r[0] for r in db.execute("SELECT weights_addr FROM versions")}
        failed = db.execute("SELECT COUNT(*) FROM tasks WHERE status = 'failed'").fetchone()[0]
        row = db.execute("SELECT failures, quarantined FROM members WHERE id = 'storm'").fetchone()
        hoarded = db.execute(
            "SELECT COUNT(*) FROM tasks WHERE owner = 'hoarder' AND status = 'leased'"
        ).fetchone()[0]
        lapsed = db.execute("SELECT expiries FROM members WHERE id = 'hoarder'").fetchone()[0]
        kinds = [r[0] for r in db.execute("SELECT kind FROM events WHERE detail LIKE 'storm%'")]
        dead = db.execute(
            "SELECT COUNT(*) FROM events WHERE kind = 'member_dead' AND detail NOT LIKE 'storm %' "
            "AND detail NOT LIKE 'hoarder %' AND detail NOT LIKE 'watcher %'"
        ).fetchone()[0]
        ids = [i for (r,) in db.execute("SELECT traj_ids FROM batches") for i in json.loads(r)]
    assert versions == list(range(1, steps + 1))
    assert addrs == {f"tcp://localhost:{wport}"}, addrs
    assert len(ids) == len(set(ids)) == steps * 32
    assert failed == 0, "the storm's errors failed tasks"
    assert hoarded == 0 and lapsed == len(held), "heartbeats kept hoarded leases past rollout.lease_max_age_s"
    assert row is not None and row[0] == errors and row[1], row
    assert kinds.count("member_quarantined") == 1
    assert kinds.count("member_error") == 1, kinds
    assert dead == 0, "a healthy member was declared dead during the flood"
    print(f"storm sent {errors} errors before its quarantine; {limited} heartbeats rate-limited")

"""Attacks on a live run by peers without keys: real controller, RaaS and trainer processes on
loopback, hostile raw sockets in this process. Each attack is refused, and the run finishes with
every step trained once, nothing forged in a batch, and the workers that were asked to leave gone.
(Attacks that need a forged identity under CURVE are tested with the keys.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from astraflow.protocol import messages as m
from astraflow.protocol import packed
from astraflow.protocol.codec import encode
from astraflow.state.batches import decode_ids
from tests.chaos.cluster import Cluster, ro
from tests.security.peers import Peer


def _versions(peer: Peer) -> dict[str, int]:
    beat = peer.ask(m.Heartbeat())
    assert isinstance(beat, m.HeartbeatAck)
    return {v.policy: v.version for v in beat.versions} or {"main": 0}


def _astraflow(*args: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.chaos
@pytest.mark.timeout(900)  # several processes on 2 shared cores
def test_attacks_fail_and_the_run_finishes(tiny_model: Path, tmp_path: Path) -> None:
    steps, slots = 12, 4
    overrides = (
        "policy.batch_prompts=4",
        "policy.group_size=8",
        f"rollout.slots={slots}",
        "rollout.lease_timeout_s=3.0",
        "controller.member_timeout_s=4.0",
        "controller.forget_after_s=2.0",
    )
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    ctx = zmq.Context()
    with Cluster(tmp_path, tiny_model, steps, *overrides) as c:
        ctl = c.controller()
        deadline = time.monotonic() + 120
        while not (c.run_dir / "controller.addr").exists():
            assert ctl.poll() is None and time.monotonic() < deadline, c.log("controller.log")
            time.sleep(0.05)

        # a rogue worker: trainer messages, the last step again and again, a version from nowhere
        rogue = Peer(ctx, c.addr, "rogue")
        assert isinstance(rogue.hello("raas"), m.Welcome)
        for msg in (
            m.VersionPublished(policy="main", version=steps, step=steps, weights_addr="tcp://127.0.0.1:9"),
            m.VersionPublished(policy="main", version=1000, step=2, weights_addr="tcp://127.0.0.1:9"),
            *[m.BatchRequest(policy="main", step=steps) for _ in range(20)],
            m.BatchRequest(policy="main", step=1),
        ):
            r = rogue.ask(msg)
            assert isinstance(r, m.Error) and r.code == "not_authorized", r

        # it asks for 1,024 tasks: it gets its slots' worth
        g = rogue.ask(m.TaskRequest(n=1024, loaded={"main": 0}))
        assert isinstance(g, m.TaskGrant) and len(g.tasks) == slots, g
        assert rogue.ask(m.TaskRequest(n=1024, loaded={"main": 0})).tasks == []  # type: ignore[attr-defined]
        hoard = g.tasks

        # forged results for its own leases: out-of-vocabulary tokens, more sequences than asked, bad lengths
        def seq(tokens: list[int], n_lp: int | None = None) -> m.Sequence:
            n = len(tokens)
            return m.Sequence(
                policy="main",
                tokens=tokens,
                loss_mask=[0] + [1] * (n - 1),
                logprobs=[0.0] + [-0.1] * ((n_lp or n) - 1),
                versions=[-1] + [0] * (n - 1),
                reward=1.0,
                sampling=m.SamplingParams(),
            )

        # and a packed array whose size is no whole number of int32s (7 bytes of tokens)
        torn = m.PackedSequence.of(seq([1, 2, 3]))
        torn.tokens = torn.tokens[:7]
        forged = [
            [m.Episode(sequences=[seq([1, vocab + 5, vocab * 9])])] * 8,
            [m.Episode(sequences=[seq([1, 2, 3])])] * 9,  # more than the group: it would overrun admission
            [m.Episode(sequences=[seq([1, 2, 3], n_lp=2)])] * 8,
            [m.PackedEpisode(sequences=[torn])] * 8,
        ]
        for task, episodes in zip(hoard, forged, strict=True):
            r = rogue.ask(m.TaskResult(task_id=task.task_id, epoch=task.epoch, episodes=episodes))
            assert isinstance(r, m.Error) and r.code == "bad_result", r
        assert "tokens is 7 bytes, not a whole number of 4-byte items" in r.message, r

        # it keeps heartbeating without reporting progress for longer than a lease: it keeps nothing
        until = time.monotonic() + 4.5
        while time.monotonic() < until:
            rogue.tell(m.Heartbeat(loaded={"main": 0}))
            time.sleep(0.3)
        with ro(c.run_dir) as db:
            held = db.execute(
                "SELECT COUNT(*) FROM tasks WHERE owner='rogue' AND status='leased'"
            ).fetchone()[0]
        assert held == 0, "heartbeats without progress kept the rogue's leases"

        # 500 Hellos over their own connections that then go silent (4,000: test_controller_rules.py)
        t0 = time.monotonic()
        ghosts = [Peer(ctx, c.addr, f"ghost-{i}") for i in range(500)]
        for gh in ghosts:
            gh.sock.send(encode(m.Hello(member_id=gh.ident, role="raas", protocol=m.PROTOCOL_VERSION, rid=1)))
        for gh in ghosts:
            assert gh.sock.poll(60_000), "a Hello got no answer"
            gh.close()
        ghosts_s = time.monotonic() - t0
        # a 9 MB Hello is refused at decode (the wire caps Hello.hardware at 255 characters): nothing stored
        big = Peer(ctx, c.addr, "big")
        refused = big.hello("raas", hardware="x" * 9_000_000)
        assert isinstance(refused, m.Error) and refused.code == "bad_message", refused
        big.close()

        # a worker that holds leases gets SIGTERM: it drains (finishes or returns them) and exits 0
        workers = {2: c.raas(2)}
        deadline = time.monotonic() + 400

        def owners() -> set[str]:
            with ro(c.run_dir) as db:
                return {r[0] for r in db.execute("SELECT DISTINCT owner FROM tasks WHERE status != 'queued'")}

        while "raas-2" not in owners() and time.monotonic() < deadline:
            assert workers[2].poll() is None, c.log("raas-2.log")
            time.sleep(0.1)
        workers[2].send_signal(signal.SIGTERM)
        assert workers[2].wait(timeout=120) == 0, c.log("raas-2.log")

        # admission is held until raas-1 has left, so the run cannot end before the leave below (it
        # did once: 12 steps finished while `astraflow leave` was starting, and raas-1 simply stopped)
        _astraflow("ctl", "pause", "--controller", c.addr)

        # the other workers and the trainer; an impostor trainer as soon as the real one is there
        workers.update({0: c.raas(0), 1: c.raas(1)})
        trainer = c.trainer()
        impostor = Peer(ctx, c.addr, "trainer-evil")
        alive: set[str] = set()
        while time.monotonic() < deadline and not {"trainer-main", "raas-1"} <= alive:
            doc = impostor.ask(m.StatusRequest()).status  # type: ignore[attr-defined]
            alive = {mm["id"] for mm in doc["members"] if mm["status"] == "alive"}
            time.sleep(0.05)
        r = impostor.hello("trainer")
        assert isinstance(r, m.Error) and r.code == "trainer_taken", r

        # `astraflow leave raas-1`: it drains and exits 0 while raas-0 finishes the run
        _astraflow("leave", "raas-1", "--controller", c.addr)
        assert workers[1].wait(timeout=300) == 0, c.log("raas-1.log")
        _astraflow("ctl", "resume", "--controller", c.addr)
        rogue.close()
        impostor.close()

        assert trainer.wait(timeout=300) == 0, c.log("trainer.log")
        assert ctl.wait(timeout=60) == 0, c.log("controller.log")
        assert workers[0].wait(timeout=60) == 0
    ran_leave = "leave" in c.log("raas-1.log", tail=100_000) or "draining" in c.log(
        "raas-1.log", tail=100_000
    )
    ctx.destroy(linger=0)

    with ro(c.run_dir) as db:
        assert [r[0] for r in db.execute("SELECT version FROM versions ORDER BY version")] == list(
            range(1, steps + 1)
        )
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in decode_ids(row)]
        assert len(ids) == len(set(ids)) == steps * 32, "a trajectory was trained twice or a batch is short"
        for (blob,) in db.execute("SELECT tokens FROM token_groups"):
            assert max(packed.ints(blob)) < vocab  # stored as the packed int32 arrays the results carried
        assert (
            db.execute("SELECT COUNT(*) FROM tasks WHERE owner='rogue' AND status='done'").fetchone()[0] == 0
        )
        members = [r[0] for r in db.execute("SELECT id FROM members")]
        hw = db.execute("SELECT MAX(LENGTH(hardware)) FROM members").fetchone()[0]
        events = [r[0] for r in db.execute("SELECT detail FROM events WHERE kind = 'member_left'")]
        fails = json.loads(
            db.execute("SELECT state FROM stage_state WHERE policy = '' AND stage = -2").fetchone()[0]
        )
    assert len(members) < 100, f"{len(members)} member rows kept after the silent Hellos"
    assert hw is None or hw <= 128
    assert any(e.startswith("raas-1 ") for e in events) and any(e.startswith("raas-2 ") for e in events)
    assert fails["by_reason"].get("invalid_result") == len(forged)
    assert "draining" in c.log("raas-2.log", tail=100_000)
    assert ran_leave, c.log("raas-1.log")
    print(f"500 silent Hellos took {ghosts_s:.1f}s")

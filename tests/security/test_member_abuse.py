"""Members with a valid key that try to stop or starve a run, against real processes on loopback: a
controller with a key store, a RaaS worker and a trainer started by `astraflow join` with their own
keys, and rogue members (tests/security/rogue.py), each a process of its own holding a registered key.

Every step waits for what the controller recorded (state.db, replies), never for the clock: the
attack happens first, its containment is checked, and only then does the healthy run go on to
finish, with every step trained, every trajectory consumed once and no task failed.
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zmq.utils import z85

from astraflow.state.batches import decode_ids
from astraflow.transport.keys import KeyStore, load_keypair, new_key_files
from astraflow.weights.pull_limit import PER_KEY
from tests.chaos.cluster import ROOT, Cluster, ro
from tests.ports import free_port

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]  # several processes on 2 shared cores

SMALL = ("policy.batch_prompts=4", "policy.group_size=4", "rollout.slots=2")
"""A run of a few tasks a step; one worker holds at most 2 of them."""


class Rogue:
    """A rogue member process; do() sends it one command and returns its one-line JSON answer."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    def do(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        # the rogue's own waits are at most 30 s per reply (timeout_s when given)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120.0 + float(args.get("timeout_s", 0)))
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"rogue gave no answer to {op}: {self.log.read_text()[-2000:]}"
        out: dict[str, Any] = json.loads(line)
        assert out["type"] != "exception", out
        return out

    def quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class KeyedCluster(Cluster):
    """The chaos Cluster with authentication: RUN/keys, and a registered key pair per member."""

    def __init__(self, tmp_path: Path, model: Path, steps: int, *overrides: str) -> None:
        super().__init__(tmp_path, model, steps, *overrides)
        self.store = KeyStore.init(self.run_dir / "keys")
        self.controller_key = self.run_dir / "keys" / "controller.key"

    def key(self, name: str, role: str, policy: str | None = None) -> Path:
        """A new key pair for `name`, registered in role; its secret file."""
        _, secret = new_key_files(self.tmp / "member-keys", name)
        self.store.add(name, load_keypair(secret).public, role, policy)
        return secret

    def creds(self, secret: Path) -> list[str]:
        return ["--key", str(secret), "--controller-key", str(self.controller_key)]

    def raas(self, i: int) -> subprocess.Popen[bytes]:
        secret = self.key(f"raas-{i}", "raas")
        args = ["join", "--role", "raas", "--controller", self.addr, *self.creds(secret)]
        return self.start(args, f"raas-{i}.log")

    def trainer(self, log: str = "trainer.log", *extra: str) -> subprocess.Popen[bytes]:
        secret = self.key("trainer-main", "trainer", "main")
        args = ["join", "--role", "trainer", "--controller", self.addr, "--policy", "main"]
        args += [*self.creds(secret), "--keys", str(self.run_dir / "keys"), *extra]
        return self.start([*args, "--checkpoint-dir", str(self.checkpoints)], log)

    def rogue(self, secret: Path, routing_id: str = "") -> Rogue:
        log = self.tmp / f"rogue-{secret.stem}-{len(self.procs)}.log"
        args = [sys.executable, "-m", "tests.security.rogue", "--controller", self.addr, *self.creds(secret)]
        pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        p = subprocess.Popen(
            [*args, "--routing-id", routing_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env={**os.environ, "PYTHONPATH": pythonpath},
        )
        self.procs.append(p)  # type: ignore[arg-type]
        return Rogue(p, log)

    def started(self) -> subprocess.Popen[bytes]:
        ctl = self.controller()
        self.until(
            lambda: (self.run_dir / "controller.addr").exists(), "controller up", ctl, "controller.log"
        )
        return ctl

    def one(self, sql: str, *args: object) -> Any:
        with ro(self.run_dir) as db:
            return db.execute(sql, args).fetchone()[0]

    def until(
        self,
        ready: Callable[[], bool],
        what: str,
        watch: subprocess.Popen[bytes],
        log: str,
        limit_s: float = 180,
    ) -> None:
        """Wait for an event; fail at once if `watch` dies, and after limit_s (a safety net only)."""
        deadline = time.monotonic() + limit_s
        while not ready():
            assert watch.poll() is None, f"{log} ended while waiting for {what}: {self.log(log)}"
            assert time.monotonic() < deadline, f"no {what} after {limit_s}s"
            time.sleep(0.1)

    def finish(
        self,
        ctl: subprocess.Popen[bytes],
        trainer: subprocess.Popen[bytes],
        worker: subprocess.Popen[bytes],
        rogues: list[Rogue],
    ) -> None:
        """The healthy run ends: the trainer and the worker exit 0; the rogues (connected all along)
        leave, and the controller exits 0."""
        assert trainer.wait(timeout=240) == 0, self.log("trainer.log")
        assert worker.wait(timeout=120) == 0, self.log("raas-0.log")
        for r in rogues:
            r.quit()
        assert ctl.wait(timeout=120) == 0, self.log("controller.log")

    def nothing_lost(self) -> None:
        """Every step trained once, every consumed trajectory used once, no task failed."""
        with ro(self.run_dir) as db:
            versions = [r[0] for r in db.execute("SELECT version FROM versions WHERE version > 0 ORDER BY 1")]
            ids = [i for (r,) in db.execute("SELECT traj_ids FROM batches") for i in decode_ids(r)]
            failed = db.execute("SELECT COUNT(*) FROM tasks WHERE status = 'failed'").fetchone()[0]
        assert versions == list(range(1, self.steps + 1))
        assert len(ids) == len(set(ids)) == self.steps * 16
        assert failed == 0, f"{failed} tasks failed"

    def alive(self, *members: str) -> bool:
        with ro(self.run_dir) as db:
            q = f"SELECT COUNT(*) FROM members WHERE status = 'alive' AND id IN ({','.join('?' * len(members))})"
            return int(db.execute(q, members).fetchone()[0]) == len(members)


def test_error_storm_is_quarantined_and_burns_no_task(tiny_model: Path, tmp_path: Path) -> None:
    """A raas key answering `error` for every lease: with one attempt per task and one failed task
    ending the run, its errors would end the run at once if they counted against tasks."""
    c = KeyedCluster(
        tmp_path, tiny_model, 2, *SMALL, "rollout.max_attempts=1", "rollout.max_failed_tasks=1",
        "controller.quarantine_after=3",
    )  # fmt: skip
    with c:
        storm = c.rogue(c.key("storm", "raas"))
        ctl = c.started()
        assert storm.do("hello", member_id="storm")["type"] == "Welcome"
        held = storm.do("lease", n=3)["tasks"]
        assert len(held) == 3, held
        storm.do("beat", on=True)
        worker = c.raas(0)
        c.until(
            lambda: c.one("SELECT COUNT(*) FROM tasks WHERE status = 'done'") > 0,
            "a result",
            worker,
            "raas-0.log",
        )

        acks = storm.do("fail")["acks"]
        assert len(acks) == 3 and ctl.poll() is None, (acks, c.log("controller.log"))
        with ro(c.run_dir) as db:
            failures, why = db.execute(
                "SELECT failures, quarantined FROM members WHERE id = 'storm'"
            ).fetchone()
            events = db.execute("SELECT COUNT(*) FROM events WHERE kind = 'member_quarantined'").fetchone()[0]
            attempts = [
                r[0] for r in db.execute(f"SELECT status FROM tasks WHERE id IN ({','.join(map(str, held))})")
            ]
        assert failures == 3 and "raas-0" in why and events == 1, (failures, why, events)
        assert "failed" not in attempts, attempts  # each went back to the queue, no attempt burned
        assert storm.do("lease", n=64)["tasks"] == [], "a quarantined member was leased tasks"
        assert storm.do("status")["members"]["storm"]["quarantined"], "status does not show the quarantine"

        c.finish(ctl, c.trainer(), worker, [storm])
    c.nothing_lost()
    assert c.one("SELECT COUNT(*) FROM tasks WHERE owner = 'storm' AND status = 'done'") == 0


def test_hoarding_is_capped_and_lapses_and_a_flood_is_limited(tiny_model: Path, tmp_path: Path) -> None:
    """A raas key asking for every task and heartbeating them as in progress, and one flooding
    heartbeats with a 60 KB error while the run's members are connected: the run goes on beside both."""
    c = KeyedCluster(
        tmp_path, tiny_model, 8, *SMALL, "rollout.lease_max_age_s=4", "rollout.lease_timeout_s=3"
    )
    with c:
        peer = c.rogue(c.key("flooder", "raas"))
        hoarder = c.rogue(c.key("hoarder", "raas"))
        admin = c.rogue(c.key("admin", "operator"))
        ctl = c.started()
        assert peer.do("hello", member_id="flooder")["type"] == "Welcome"
        assert peer.do("lease", n=0)["tasks"] == []  # a live peer; its request admits the first tasks
        peer.do("beat", on=True)
        assert hoarder.do("hello", member_id="hoarder")["type"] == "Welcome"

        # hoarding: nobody else works, so what is open is fixed while the hoarder asks for everything
        held = hoarder.do("lease", n=1024)["tasks"]
        open_ = c.one("SELECT COUNT(*) FROM tasks WHERE status IN ('queued', 'leased')")
        assert 0 < len(held) <= math.ceil(open_ * 0.5) < open_, (len(held), open_)
        hoarder.do("beat", on=True)  # heartbeats list every hoarded lease as in progress
        c.until(
            lambda: c.one("SELECT COUNT(*) FROM tasks WHERE owner = 'hoarder' AND status = 'leased'") == 0,
            "the hoarded leases to lapse (rollout.lease_max_age_s)",
            ctl,
            "controller.log",
        )
        assert c.one("SELECT expiries FROM members WHERE id = 'hoarder'") == len(held)
        assert c.one("SELECT status FROM members WHERE id = 'hoarder'") == "alive"

        # the healthy members train a step beside the hoarder, then wait, paused, while the flood comes
        trainer, worker = c.trainer(), c.raas(0)
        c.until(lambda: c.steps_done() >= 1, "a step trained beside the hoarder", trainer, "trainer.log")
        assert admin.do("control", action="pause")["type"] == "Ack"
        c.until(lambda: c.alive("raas-0", "trainer-main"), "the members alive", trainer, "trainer.log")
        before = c.one("SELECT COALESCE(MAX(id), 0) FROM events")

        # heartbeat flood with one repeated 60 KB error: rate-limited, the error written once
        replies = peer.do("flood", n=300, size=60_000)["replies"]
        # the first beats of the burst are taken (the first answered; the rest are idle beats, answered
        # only with news), every one past the burst is refused
        assert replies.get("HeartbeatAck", 0) > 0, replies
        assert 300 - 25 <= replies.get("rate_limited", 0) < 300, replies
        errors = c.one("SELECT COUNT(*) FROM events WHERE kind = 'member_error' AND detail LIKE 'flooder:%'")
        assert errors == 1, errors
        assert admin.do("status")["type"] == "StatusReply"  # the controller's loop is past the flood
        dead = c.one(
            "SELECT COUNT(*) FROM events WHERE id > ? AND kind = 'member_dead' AND "
            "(detail LIKE 'raas-0 %' OR detail LIKE 'trainer-main %')",
            before,
        )
        assert dead == 0, "a healthy member was declared dead during the flood"

        assert admin.do("control", action="resume")["type"] == "Ack"
        c.finish(ctl, trainer, worker, [peer, hoarder, admin])
    c.nothing_lost()
    assert c.one("SELECT failures + invalid FROM members WHERE id = 'hoarder'") == 0


def test_squatting_revoked_keys_and_weight_pulls(tiny_model: Path, tmp_path: Path) -> None:
    """An observer key squatting the trainer's routing id, weight pulls by an observer key and by many
    connections of one raas key, and a revoke that frees a member id for a new key. The trainer
    announces its weight server under --advertise (a name it does not bind) on a fixed --weights-port."""
    c = KeyedCluster(tmp_path, tiny_model, 2, *SMALL)
    wport = free_port()
    with c:
        squatter = c.rogue(c.key("ops", "observer"), routing_id="trainer-main")
        ctl = c.started()
        reply = squatter.do("hello", member_id="trainer-main", role="trainer")
        assert reply["type"] == "Error" and reply["code"] == "bad_identity", reply

        # the real trainer joins at once while the squatter's connection stays open
        trainer = c.trainer("trainer.log", "--advertise", "localhost", "--weights-port", str(wport))
        c.until(lambda: _listens(wport), "the trainer's weight server", trainer, "trainer.log")
        assert squatter.do("status")["members"]["trainer-main"]["status"] == "alive"

        # weight plane: an observer key is refused; one raas key gets PER_KEY connections answered
        public = load_keypair(c.tmp / "member-keys" / "trainer-main.key_secret").public
        addr = f"tcp://127.0.0.1:{wport}#curve={z85.decode(public).hex()}"
        assert squatter.do("weights", addr=addr, connections=1, quiet_s=1.5) == {
            "type": "weights", "refused": 1, "answered": 0
        }  # fmt: skip
        puller = c.rogue(c.key("raas-1", "raas"))
        pulls = puller.do("weights", addr=addr, connections=PER_KEY + 8, quiet_s=2.0)
        assert pulls["refused"] == 0 and pulls["answered"] == PER_KEY, pulls

        # revoke: the squatter's open connection routes nothing; raas-1 pulls nothing more, and its
        # member id takes a new key (`keys add` again under the revoked name)
        for name in ("ops", "raas-1"):
            done = subprocess.run(
                [sys.executable, "-m", "astraflow", "keys", "revoke", name, "--keys", str(c.run_dir / "keys")],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
        assert squatter.do("status", timeout_s=1.5)["type"] is None, "a revoked key's connection was answered"
        assert puller.do("weights", addr=addr, connections=1, quiet_s=1.5)["refused"] == 1
        for old in ("raas-1.key", "raas-1.key_secret"):
            (c.tmp / "member-keys" / old).rename(c.tmp / f"revoked-{old}")
        fresh = c.rogue(c.key("raas-1", "raas"))
        assert fresh.do("hello", member_id="raas-1")["type"] == "Welcome"
        assert fresh.do("weights", addr=addr, connections=1, quiet_s=60.0)["answered"] == 1

        # the healthy run finishes beside them
        c.finish(ctl, trainer, c.raas(0), [squatter, puller, fresh])
    c.nothing_lost()
    assert c.one("SELECT COUNT(DISTINCT weights_addr) FROM versions WHERE version > 0") == 1
    assert c.one("SELECT weights_addr FROM versions WHERE version = 1").startswith(f"tcp://localhost:{wport}")


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False

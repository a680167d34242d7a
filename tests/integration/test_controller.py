"""The controller as a real process on loopback, driven by raw DEALER sockets and the codec."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from astraflow.protocol.codec import decode, encode
from astraflow.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    BatchReply,
    BatchRequest,
    Bye,
    Episode,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Msg,
    ResultAck,
    SamplingParams,
    Sequence,
    StatusReply,
    StatusRequest,
    TaskGrant,
    TaskRequest,
    TaskResult,
    VersionPublished,
    Welcome,
)

RECIPE = {
    "run": {"name": "ctl-test", "seed": 3, "steps": 2},
    "policy": [{"name": "main", "model": "unused", "group_size": 2, "batch_prompts": 1, "max_staleness": 1}],
    "workflow": {"name": "quickstart", "options": {"size": 5}},
    "rollout": {"lease_timeout_s": 1.0},
    "controller": {"member_timeout_s": 30.0},
}

START = (
    "import json, sys; from pathlib import Path; from astraflow import log; log.setup('controller');"
    "from astraflow.config.recipe import Recipe; from astraflow.roles.controller import run_controller;"
    "sys.exit(run_controller(Recipe.model_validate(json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2])))"
)


def _start(run_dir: Path, recipe_dict: dict | None = None) -> tuple[subprocess.Popen[bytes], str]:
    (run_dir / "controller.addr").unlink(missing_ok=True)
    recipe = run_dir / "recipe.json"
    recipe.write_text(json.dumps(recipe_dict or RECIPE))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", START, str(recipe), str(run_dir)],
        env=env,
        stderr=open(run_dir / "controller.log", "ab"),
    )
    for _ in range(300):
        addr = run_dir / "controller.addr"
        if addr.exists():
            return proc, addr.read_text().strip()
        assert proc.poll() is None, (run_dir / "controller.log").read_text()
        time.sleep(0.05)
    raise AssertionError("controller did not start")


class Peer:
    """A raw DEALER socket with a fixed identity."""

    def __init__(self, ctx: zmq.Context, addr: str, ident: str) -> None:
        self.ident = ident
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, ident.encode())
        self.sock.connect(addr)
        self.rid = 0

    def ask(self, msg: Msg) -> Msg:
        self.rid += 1
        msg.rid = self.rid
        self.sock.send(encode(msg))
        return self.recv(msg.rid)

    def recv(self, rid: int) -> Msg:
        assert self.sock.poll(10_000), "no reply"
        reply = decode(self.sock.recv())
        assert reply.rid == rid
        return reply

    def hello(self, role: str) -> Msg:
        return self.ask(
            Hello(
                member_id=self.ident,
                role=role,
                protocol=PROTOCOL_VERSION,
                policies=["main"],
                hardware="cpu:1",
            )
        )


def _episodes(rewards: list[float], version: int = 0) -> list[Episode]:
    return [
        Episode(
            sequences=[
                Sequence(
                    policy="main",
                    tokens=[5, 6, 7],
                    loss_mask=[0, 1, 1],
                    logprobs=[0.0, -0.1, -0.2],
                    versions=[-1, version, version],
                    reward=r,
                    sampling=SamplingParams(),
                )
            ]
        )
        for r in rewards
    ]


@pytest.fixture()
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_controller_protocol_ledger_batches_and_resume(tmp_path: Path, ctx: zmq.Context) -> None:
    proc, addr = _start(tmp_path)
    try:
        raas = Peer(ctx, addr, "raas-a")
        bad = raas.ask(Hello(member_id="raas-a", role="raas", protocol=PROTOCOL_VERSION + 9))
        assert isinstance(bad, Error) and bad.code == "protocol_version"
        assert isinstance(raas.ask(TaskRequest(n=1)), Error)  # not joined yet: unknown_member
        welcome = raas.hello("raas")
        assert isinstance(welcome, Welcome) and welcome.run_name == "ctl-test"
        assert welcome.sections["seed"] == 3 and list(welcome.sections["policies"]) == ["main"]
        imposter = Peer(ctx, addr, "raas-x")
        refused = imposter.ask(Hello(member_id="raas-a", role="raas", protocol=PROTOCOL_VERSION))
        assert isinstance(refused, Error) and refused.code == "bad_identity"

        grant = raas.ask(TaskRequest(n=8, loaded={"main": 0}))
        assert isinstance(grant, TaskGrant)
        # S=1, batch of 2 sequences, group 2: admission lets 2 prompts be outstanding
        assert len(grant.tasks) == 2
        t1, t2 = grant.tasks
        assert t1.group_size == 2 and t1.roles == {"actor": "main"} and t1.sample["key"] == "copy-0"
        assert "prompt" in t1.sample and t1.epoch == 1

        ack = raas.ask(TaskResult(task_id=t1.task_id, epoch=t1.epoch, episodes=_episodes([0.0, 1.0])))
        assert isinstance(ack, ResultAck) and ack.status == "accepted"
        dup = raas.ask(TaskResult(task_id=t1.task_id, epoch=t1.epoch, episodes=_episodes([0.0, 1.0])))
        assert isinstance(dup, ResultAck) and dup.status == "duplicate"
        unknown = raas.ask(TaskResult(task_id=999, epoch=1, episodes=[]))
        assert isinstance(unknown, ResultAck) and unknown.status == "unknown_task"

        # raas-a's lease on t2 expires (no heartbeat renews it); raas-b takes it over
        time.sleep(1.5)
        other = Peer(ctx, addr, "raas-b")
        assert isinstance(other.hello("raas"), Welcome)
        g2 = other.ask(TaskRequest(n=4, loaded={"main": 0}))
        assert isinstance(g2, TaskGrant) and [t.task_id for t in g2.tasks] == [t2.task_id]
        assert g2.tasks[0].epoch == t2.epoch + 1
        late = raas.ask(TaskResult(task_id=t2.task_id, epoch=t2.epoch, episodes=_episodes([1.0, 1.0])))
        assert isinstance(late, ResultAck) and late.status == "stale_epoch"
        ok = other.ask(
            TaskResult(task_id=t2.task_id, epoch=g2.tasks[0].epoch, episodes=_episodes([0.5, 0.0]))
        )
        assert isinstance(ok, ResultAck) and ok.status == "accepted"
        garbage_reply = (raas.sock.send(b"\x93\x01\x02"), raas.recv(0))[1]
        assert isinstance(garbage_reply, Error)

        trainer = Peer(ctx, addr, "trainer-main")
        assert isinstance(trainer.hello("trainer"), Welcome)
        b1 = trainer.ask(BatchRequest(policy="main", step=1))
        assert isinstance(b1, BatchReply) and b1.ready and len(b1.samples) == 2
        assert sorted(s.reward for s in b1.samples) == [0.0, 1.0]
        assert b1.samples[0].advantage == pytest.approx(-b1.samples[1].advantage)
        again = trainer.ask(BatchRequest(policy="main", step=1))
        assert [s.traj_id for s in again.samples] == [s.traj_id for s in b1.samples]
        done = trainer.ask(BatchRequest(policy="main", step=3))
        assert isinstance(done, BatchReply) and done.done
        assert isinstance(trainer.ask(BatchRequest(policy="nope", step=1)), Error)

        pub = trainer.ask(
            VersionPublished(
                policy="main", version=1, step=1, weights_addr="tcp://127.0.0.1:1", metrics={"loss": 0.5}
            )
        )
        assert isinstance(pub, Ack)
        hb = raas.ask(Heartbeat(loaded={"main": 1}))
        assert isinstance(hb, HeartbeatAck) and not hb.stop and hb.versions[0].version == 1
        line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
        assert line["policy"] == "main" and line["step"] == 1 and line["version"] == 1
        assert line["reward_mean"] == pytest.approx(0.5) and line["loss"] == 0.5 and "staleness_max" in line

        status = raas.ask(StatusRequest())
        assert isinstance(status, StatusReply)
        assert status.status["tasks"]["done"] == 2 and status.status["policies"][0]["version"] == 1
        assert isinstance(other.ask(Bye(reason="test")), Ack)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # restart on the same run directory: versions, members and recorded batches come back
    proc, addr = _start(tmp_path)
    try:
        trainer = Peer(ctx, addr, "trainer-main")
        b1r = trainer.ask(BatchRequest(policy="main", step=1))
        assert isinstance(b1r, BatchReply) and [s.traj_id for s in b1r.samples] == [
            s.traj_id for s in b1.samples
        ]
        status = trainer.ask(StatusRequest())
        assert status.status["policies"][0]["step"] == 1
        members = {m["id"]: m["status"] for m in status.status["members"]}
        assert members["raas-b"] == "left" and members["raas-a"] == "alive"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_end_stops_members_and_exits(tmp_path: Path, ctx: zmq.Context) -> None:
    proc, addr = _start(tmp_path, {**RECIPE, "run": {"name": "end", "steps": 1}})
    try:
        raas, trainer = Peer(ctx, addr, "raas-a"), Peer(ctx, addr, "trainer-main")
        assert isinstance(raas.hello("raas"), Welcome) and isinstance(trainer.hello("trainer"), Welcome)
        grant = raas.ask(TaskRequest(n=1, loaded={"main": 0}))
        (task,) = grant.tasks
        assert (
            raas.ask(
                TaskResult(task_id=task.task_id, epoch=task.epoch, episodes=_episodes([1.0, 0.0]))
            ).status
            == "accepted"
        )
        assert trainer.ask(BatchRequest(policy="main", step=1)).ready
        assert isinstance(
            trainer.ask(VersionPublished(policy="main", version=1, step=1, weights_addr="")), Ack
        )
        assert raas.ask(Heartbeat()).stop is True
        assert raas.ask(TaskRequest(n=1)).stop is True
        assert isinstance(trainer.ask(Bye()), Ack) and isinstance(raas.ask(Bye()), Ack)
        assert (
            proc.wait(timeout=20) == 0
        )  # every member left after the budget: the controller exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

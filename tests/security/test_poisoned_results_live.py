"""Poisoned results against a live run: a real controller and a real trainer process on loopback, and
a rogue worker in this process (a raw socket speaking the codec) that does all the rollouts.

It sends 16 rewards of 1.7e307, a reward of 1e308 and a 200,000-token sequence: each is refused with
its reason and nothing of them is stored, and the run goes on (two steps train on its good results,
each batch streamed to the trainer in several parts). Then it sends results whose behaviour logprobs
(-900, finite, accepted) make the trainer's loss infinite: the trainer skips those steps without
changing a weight (the skipped step's version has the previous one's sha256), the controller records
them and `astraflow status` shows them, and after policy.max_nonfinite_steps in a row the trainer
exits 1 with the reason. Nothing NaN reaches state.db or metrics.jsonl. A trainer whose weights turn
non-finite (an absurd learning rate) stops before publishing them."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from astraflow.protocol import messages as m
from astraflow.protocol import packed
from tests.chaos.cluster import Cluster, ro
from tests.security.peers import Peer

GROUP = 16


class Rogue:
    """A worker with a real identity that makes up its results; it heartbeats while it waits."""

    def __init__(self, ctx: zmq.Context, addr: str, vocab: int) -> None:
        self.peer = Peer(ctx, addr, "rogue")
        welcome = self.peer.hello("raas", slots=2)  # its reply comes within Peer.ask's 20 s
        assert isinstance(welcome, m.Welcome), welcome
        self.vocab = vocab
        self.version = 0
        self.rng = random.Random(0)

    def seq(self, *, reward: float, n: int = 24, logprob: float = -3.0) -> m.Sequence:
        prompt = 8
        return m.Sequence(
            policy="main",
            tokens=[self.rng.randrange(4, self.vocab) for _ in range(n)],
            loss_mask=[0] * prompt + [1] * (n - prompt),
            logprobs=[0.0] * prompt + [logprob] * (n - prompt),
            versions=[-1] * prompt + [self.version] * (n - prompt),
            reward=reward,
            sampling=m.SamplingParams(),
        )

    def group(self, **kw: float) -> list[m.Episode]:
        return [m.Episode(sequences=[self.seq(reward=float(i % 2), **kw)]) for i in range(GROUP)]

    def lease(self) -> m.Task:
        """One task, asked for (and heartbeating) until the controller grants one."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            g = self.peer.ask(m.TaskRequest(n=1, loaded={"main": self.version}), timeout_ms=120_000)
            assert isinstance(g, m.TaskGrant), g
            if g.tasks:
                return g.tasks[0]
            self.beat()
            time.sleep(0.2)
        raise AssertionError("no task leased within 120s")

    def send(self, episodes: list[m.Episode]) -> m.Msg:
        t = self.lease()
        return self.peer.ask(
            m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=episodes), timeout_ms=120_000
        )

    def beat(self) -> None:
        """A heartbeat (not answered each time), then the versions from a request for no task."""
        self.peer.tell(m.Heartbeat(loaded={"main": self.version}))
        grant = self.peer.ask(m.TaskRequest(n=0, loaded={"main": self.version}), timeout_ms=120_000)
        assert isinstance(grant, m.TaskGrant), grant
        self.version = max([self.version, *(v.version for v in grant.versions if v.policy == "main")])

    def wait_version(self, version: int, trainer: subprocess.Popen[bytes], log: str) -> None:
        deadline = time.monotonic() + 240
        while self.version < version:
            assert trainer.poll() is None and time.monotonic() < deadline, log
            self.beat()
            time.sleep(0.2)


def _finite_json(text: str) -> object:
    def refuse(name: str) -> float:
        raise AssertionError(f"{name} in metrics.jsonl")

    return json.loads(text, parse_constant=refuse)


def _start(c: Cluster, ctx: zmq.Context, model: Path) -> tuple[subprocess.Popen[bytes], Rogue]:
    """The controller, then the trainer and the rogue worker."""
    ctl = c.controller()
    deadline = time.monotonic() + 120
    while not (c.run_dir / "controller.addr").exists():
        assert ctl.poll() is None and time.monotonic() < deadline, c.log("controller.log")
        time.sleep(0.05)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    return c.trainer(), Rogue(ctx, c.addr, vocab)


@pytest.mark.timeout(600)  # a controller and a trainer on 2 shared cores
def test_poisoned_results_are_refused_and_garbage_is_never_learned(tiny_model: Path, tmp_path: Path) -> None:
    overrides = (
        f"policy.group_size={GROUP}",
        "policy.batch_prompts=1",
        "policy.max_nonfinite_steps=2",
        "policy.checkpoint_every=100",
        "controller.batch_part_bytes=4096",  # a batch of 16 short sequences comes in several parts
        "controller.stall_warn_s=600",
        "controller.stall_fail_s=600",
        "controller.member_timeout_s=120",  # the rogue may be slow to heartbeat on a loaded machine
    )
    ctx = zmq.Context()
    with Cluster(tmp_path, tiny_model, 6, *overrides) as c:
        trainer, rogue = _start(c, ctx, tiny_model)

        # (b) huge finite rewards, (c) a sequence 400 times the model's max_position_embeddings: refused, with why
        huge = [m.Episode(sequences=[rogue.seq(reward=1.7e307)]) for _ in range(GROUP)]
        one = rogue.group()
        one[3] = m.Episode(sequences=[rogue.seq(reward=1e308)])
        long = rogue.group()
        long[0] = m.Episode(sequences=[rogue.seq(reward=1.0, n=200_000)])
        for episodes, why in (
            (huge, "max_abs_reward"),
            (one, "max_abs_reward"),
            (long, "max_seq_len of policy 'main' (512;"),
        ):
            r = rogue.send(episodes)
            assert isinstance(r, m.Error) and r.code == "bad_result" and why in r.message, r

        # the run goes on: two steps learn from good results, each batch fetched in parts
        for step in (1, 2):
            assert isinstance(rogue.send(rogue.group()), m.ResultAck)
            rogue.wait_version(step, trainer, c.log("trainer.log"))

        # results whose logprobs make the loss infinite: each step is skipped, the second in a row ends it
        assert isinstance(rogue.send(rogue.group(logprob=-900.0)), m.ResultAck)
        rogue.wait_version(3, trainer, c.log("trainer.log"))
        assert isinstance(rogue.send(rogue.group(logprob=-900.0)), m.ResultAck)
        deadline = time.monotonic() + 240
        while trainer.poll() is None and time.monotonic() < deadline:
            rogue.beat()
            time.sleep(0.2)
        assert trainer.wait(timeout=10) == 1, c.log("trainer.log")
        status = subprocess.run(
            [sys.executable, "-m", "astraflow", "status", "--run-dir", str(c.run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        rogue.peer.close()
    ctx.destroy(linger=0)

    trainer_log = c.log("trainer.log", tail=100_000)
    assert "2 steps in a row (the last: 4) had a non-finite loss" in trainer_log, trainer_log[-3000:]
    assert status.returncode == 0, status.stderr
    assert "1 step skipped by the trainer (non-finite loss or gradient norm): 3" in status.stdout, (
        status.stdout
    )
    with ro(c.run_dir) as db:
        versions = dict(db.execute("SELECT version, sha256 FROM versions").fetchall())
        assert sorted(versions) == [1, 2, 3], "the step that ended the trainer was published"
        assert versions[3] == versions[2] != versions[1], "a skipped step changed the weights"
        nulls = db.execute(
            "SELECT COUNT(*) FROM trajectories WHERE reward IS NULL OR advantage IS NULL"
        ).fetchone()[0]
        assert nulls == 0
        worst = db.execute("SELECT MAX(ABS(reward)) FROM trajectories").fetchone()[0]
        longest = max(
            n for (lengths,) in db.execute("SELECT lengths FROM token_groups") for n in packed.ints(lengths)
        )
        assert worst <= 1.0 and 4 * longest < 200, "a refused result was stored"
        assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 4 * GROUP
        events = db.execute("SELECT kind, detail FROM events").fetchall()
    skipped = [json.loads(d) for k, d in events if k == "step_skipped"]
    assert skipped == [{"policy": "main", "step": 3, "in_a_row": 1}], events
    # the trainer's Bye carries the reason (best effort: a Bye that misses its 1.5 s is a member_dead)
    assert all("non-finite" in d for k, d in events if k == "member_left" and d.startswith("trainer-main")), (
        events
    )
    rows = [_finite_json(line) for line in (c.run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {int(r["step"]): r for r in rows if isinstance(r, dict)}
    assert by_step[1]["trainer_batch_parts"] >= 2 and by_step[2]["trainer_batch_parts"] >= 2
    assert by_step[3]["trainer_skipped_step"] == 1.0 and "loss" not in by_step[3]
    assert by_step[2]["trainer_skipped_step"] == 0.0 and math.isfinite(by_step[2]["loss"])


@pytest.mark.timeout(600)
def test_weights_that_are_not_finite_are_never_published(tiny_model: Path, tmp_path: Path) -> None:
    """A learning rate of 1e37 with a weight decay of 100 scales the weights by -1e39 on the first
    update (to inf) while its loss and gradient norm are finite: the trainer stops with exit 1 before
    publishing them, and no version is recorded."""
    ctx = zmq.Context()
    with Cluster(
        tmp_path,
        tiny_model,
        3,
        f"policy.group_size={GROUP}",
        "policy.batch_prompts=1",
        "policy.optimizer.lr=1e37",
        "policy.optimizer.weight_decay=100",
        "controller.member_timeout_s=120",
    ) as c:
        trainer, rogue = _start(c, ctx, tiny_model)
        assert isinstance(rogue.send(rogue.group()), m.ResultAck)
        deadline = time.monotonic() + 240
        while trainer.poll() is None and time.monotonic() < deadline:
            rogue.beat()
            time.sleep(0.2)
        assert trainer.wait(timeout=10) == 1, c.log("trainer.log")
        assert rogue.version == 0
        rogue.peer.close()
    ctx.destroy(linger=0)
    assert "the weights after step 1 are not finite" in c.log("trainer.log"), c.log("trainer.log")
    with ro(c.run_dir) as db:
        assert db.execute("SELECT COUNT(*) FROM versions").fetchone()[0] == 0
        left = [d for k, d in db.execute("SELECT kind, detail FROM events") if k == "member_left"]
    assert all("not finite" in d for d in left if d.startswith("trainer-main")), left

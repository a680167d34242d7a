"""The batch stage of an advantage estimator runs in the real controller process: a trainer asking for
a batch of a reinforce_pp policy gets advantages normalised over the whole batch, in every part of a
batch served in parts, and the same again when it asks for the recorded batch once more."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
import zmq

from astraflow.protocol.messages import (
    BatchReply,
    BatchRequest,
    Episode,
    ResultAck,
    SamplingParams,
    Sequence,
    TaskGrant,
    TaskRequest,
    TaskResult,
)
from tests.integration.test_controller import RECIPE, Peer, _start, ctx  # noqa: F401


def _episodes(rewards: list[float], n: int = 24) -> list[Episode]:
    """One sequence of n tokens per episode (long enough that a batch of four comes in parts)."""
    seq = dict(tokens=[5 + i % 9 for i in range(n)], loss_mask=[0] + [1] * (n - 1))
    return [
        Episode(
            sequences=[
                Sequence(
                    policy="main",
                    logprobs=[0.0] + [-0.5] * (n - 1),
                    versions=[-1] + [0] * (n - 1),
                    reward=r,
                    sampling=SamplingParams(),
                    **seq,  # type: ignore[arg-type]
                )
            ]
        )
        for r in rewards
    ]


def test_reinforce_pp_batches_are_normalised_by_the_controller(tmp_path: Path, ctx: zmq.Context) -> None:  # noqa: F811
    recipe = {
        **RECIPE,
        "policy": [{**RECIPE["policy"][0], "batch_prompts": 2, "advantage": "reinforce_pp"}],
        "controller": {**RECIPE["controller"], "batch_part_bytes": 1024},  # the batch comes in parts
    }
    proc, addr = _start(tmp_path, recipe)
    try:
        raas = Peer(ctx, addr, "raas-a")
        raas.hello("raas")
        grant = raas.ask(TaskRequest(n=8, loaded={"main": 0}))
        assert isinstance(grant, TaskGrant) and len(grant.tasks) >= 2
        for t, rewards in zip(grant.tasks[:2], ([0.0, 1.0], [3.0, 3.0]), strict=True):
            ack = raas.ask(TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(rewards)))
            assert isinstance(ack, ResultAck) and ack.status == "accepted"
        trainer = Peer(ctx, addr, "trainer-main")
        trainer.hello("trainer")
        first = trainer.ask(BatchRequest(policy="main", step=1))
        assert isinstance(first, BatchReply) and first.ready and first.parts > 1, first

        def whole(first: BatchReply) -> list:
            out = list(first.samples)
            for part in range(1, first.parts):
                out += trainer.ask(BatchRequest(policy="main", step=1, part=part)).samples
            return out

        b1 = whole(first)
        assert len(b1) == 4
        # group stage r - mean: [-0.5, 0.5] and [0, 0]; batch: mean 0, population std sqrt(0.125)
        s = math.sqrt(0.125) + 1e-5
        by_reward = sorted((x.reward, x.advantage) for x in b1)
        assert [r for r, _ in by_reward] == [0.0, 1.0, 3.0, 3.0]
        assert [a for _, a in by_reward] == pytest.approx([-0.5 / s, 0.5 / s, 0.0, 0.0], abs=1e-9)
        # every part is normalised over the whole batch; the recorded batch asked again is the same
        again = whole(trainer.ask(BatchRequest(policy="main", step=1)))
        assert [(x.traj_id, x.advantage) for x in again] == [(x.traj_id, x.advantage) for x in b1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

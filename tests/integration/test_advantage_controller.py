"""The batch stage of an advantage estimator runs in the real controller process: a trainer asking for
a batch of a reinforce_pp policy gets advantages normalised over the whole batch, the same again when
it asks for the recorded batch once more."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
import zmq

from astraflow.protocol.messages import (
    BatchReply,
    BatchRequest,
    ResultAck,
    TaskGrant,
    TaskRequest,
    TaskResult,
)
from tests.integration.test_controller import RECIPE, Peer, _episodes, _start, ctx  # noqa: F401


def test_reinforce_pp_batches_are_normalised_by_the_controller(tmp_path: Path, ctx: zmq.Context) -> None:  # noqa: F811
    recipe = {**RECIPE, "policy": [{**RECIPE["policy"][0], "batch_prompts": 2, "advantage": "reinforce_pp"}]}
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
        b1 = trainer.ask(BatchRequest(policy="main", step=1))
        assert isinstance(b1, BatchReply) and b1.ready and len(b1.samples) == 4
        # group stage r - mean: [-0.5, 0.5] and [0, 0]; batch: mean 0, population std sqrt(0.125)
        s = math.sqrt(0.125) + 1e-5
        by_reward = sorted((x.reward, x.advantage) for x in b1.samples)
        assert [r for r, _ in by_reward] == [0.0, 1.0, 3.0, 3.0]
        assert [a for _, a in by_reward] == pytest.approx([-0.5 / s, 0.5 / s, 0.0, 0.0], abs=1e-9)
        again = trainer.ask(BatchRequest(policy="main", step=1))
        assert [(x.traj_id, x.advantage) for x in again.samples] == [
            (x.traj_id, x.advantage) for x in b1.samples
        ]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

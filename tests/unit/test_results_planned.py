"""A TaskResults' groups get their advantages in one pass over the message (`plan_advantages`): the
rows stored are bit for bit those one TaskResult each stores (every estimator the recipe can pick,
random rewards, groups of equal rewards, of signed zeros, of subnormal rewards; driven through
Controller.dispatch on a real state.db, no sockets)."""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import pytest

from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from tests.dispatch_controller import started_controller

GROUP = 16


def _controller(model: Path, run_dir: Path, advantage: str) -> Controller:
    run_dir.mkdir()
    return started_controller(model, run_dir, name="planned", group=GROUP, advantage=advantage)


def _episodes(rewards: list[float]) -> list[m.Episode]:
    seq = {
        "policy": "main",
        "tokens": [5, 6, 7],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -0.5, -0.25],
        "versions": [-1, 0, 0],
        "sampling": m.SamplingParams(),
    }
    return [m.Episode(sequences=[m.Sequence(reward=r, **seq)]) for r in rewards]  # type: ignore[arg-type]


def _grant(c: Controller, n: int) -> list[m.Task]:
    reply = c.dispatch(b"w", m.TaskRequest(n=n, loaded={"main": 0}))[0][1]
    assert isinstance(reply, m.TaskGrant) and len(reply.tasks) == n, reply
    return list(reply.tasks)


def _stored(c: Controller) -> list[tuple[Any, ...]]:
    rows = c.store.query("SELECT * FROM trajectories ORDER BY id")
    # struct keeps the sign of a zero, where == would not
    return [tuple(struct.pack("<d", v) if isinstance(v, float) else v for v in tuple(r)) for r in rows]


def _rewards(rng: random.Random, k: int) -> list[float]:
    kinds = [
        lambda: [float(rng.randint(0, 1)) for _ in range(GROUP)],
        lambda: [1.0] * GROUP,
        lambda: [rng.gauss(0, 1) for _ in range(GROUP)],
        lambda: [rng.uniform(-1, 1) * 1e6 for _ in range(GROUP)],
        lambda: [rng.choice([5e-324, 0.0, 1e-300]) for _ in range(GROUP)],
        lambda: [-0.0, 0.0] * (GROUP // 2),
    ]
    return kinds[k % len(kinds)]()


def _pair(model: Path, tmp: Path, advantage: str, n: int) -> tuple[Controller, Controller, list[m.Task]]:
    single = _controller(model, tmp / "single", advantage)
    grouped = _controller(model, tmp / "grouped", advantage)
    ts, tg = _grant(single, n), _grant(grouped, n)
    assert [(t.task_id, t.epoch) for t in ts] == [(t.task_id, t.epoch) for t in tg]
    return single, grouped, tg


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo", "reinforce_pp", "gae"])
def test_a_message_stores_the_rows_single_results_store(
    tiny_model: Path, tmp_path: Path, advantage: str
) -> None:
    single, grouped, tasks = _pair(tiny_model, tmp_path, advantage, 6)
    rng = random.Random(advantage)
    rewards = {t.task_id: _rewards(rng, k) for k, t in enumerate(tasks)}
    for t in tasks:
        ack = single.dispatch(
            b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(rewards[t.task_id]))
        )[0][1]
        assert isinstance(ack, m.ResultAck) and ack.status == "accepted", ack
    results = [
        m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(rewards[t.task_id])) for t in tasks
    ]
    reply = grouped.dispatch(b"w", m.TaskResults.of(results))[0][1]
    assert isinstance(reply, m.ResultsAck) and {a.status for a in reply.acks} == {"accepted"}, reply
    stored = _stored(grouped)
    assert stored == _stored(single) and len(stored) == 6 * GROUP
    # the group of equal rewards got 0 everywhere (gae keeps the rewards), the gaussian one did not
    advantages = [r[0] for r in grouped.store.query("SELECT advantage FROM trajectories ORDER BY id")]
    assert advantages[GROUP : 2 * GROUP] == ([1.0] if advantage == "gae" else [0.0]) * GROUP
    assert any(a != 0.0 for a in advantages[2 * GROUP : 3 * GROUP])

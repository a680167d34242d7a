"""The bench's simulated workers build their results as columns directly (bench/sim_results.py
`results`): the controller must receive the very bytes a member packing the same episodes sends."""

from __future__ import annotations

import random

import pytest

from astraflow.bench.sim_results import episodes, results
from astraflow.protocol import messages as m
from astraflow.protocol.codec import encode


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_results_built_as_columns_are_the_bytes_packing_the_episodes_gives(tokens: int) -> None:
    tasks = [
        m.Task(
            task_id=10 + i,
            epoch=1 + i % 3,
            sample={},
            group_size=[16, 64, 1][i % 3],
            roles={"actor": "main"},
            group_sizes={"main": 8} if i == 4 else {},
        )
        for i in range(9)
    ]
    packed_rng, direct_rng = random.Random(7), random.Random(7)
    outcomes = [
        m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=episodes(t, "main", 5, packed_rng, tokens))
        for t in tasks
    ]
    assert encode(results(tasks, "main", 5, direct_rng, tokens)) == encode(m.TaskResults.of(outcomes))
    assert packed_rng.random() == direct_rng.random()  # the same draws, in the same order

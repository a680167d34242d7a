"""A task's samples depend on (run seed, task id, role, call) and the weights only: not on the worker,
its engine's own stream, or the requests decoded beside them. A real engine behind the RaaS client."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
from pathlib import Path

import pytest
import torch

from astraflow.config.recipe import SamplingConfig
from astraflow.engines.base import Completion
from astraflow.engines.torch_engine import TorchEngine
from astraflow.models.init import init_model
from astraflow.roles.policy_client import EnginePolicyClient, TaskPolicyClient, sample_seed

torch.set_num_threads(1)
PROMPT = [1, 14, 5, 6, 18]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("seeds") / "tiny", seed=0)


def test_sample_seed_is_a_fixed_function_of_its_parts() -> None:
    s = sample_seed(0, 7, "actor", 0)
    assert s == sample_seed(0, 7, "actor", 0) and 0 <= s < 2**48
    others = {sample_seed(1, 7, "actor", 0), sample_seed(0, 8, "actor", 0), sample_seed(0, 7, "judge", 0)}
    others.add(sample_seed(0, 7, "actor", 1))
    assert s not in others and len(others) == 4


def run_task(model_dir: Path, engine_seed: int, task_id: int, beside: int) -> list[list[Completion]]:
    """Two generate calls of one task (16 samples, then 4) on a fresh engine, with `beside` unseeded
    requests of another prompt decoded in the same batches."""
    eng = TorchEngine(str(model_dir), seed=engine_seed)
    base = EnginePolicyClient("main", None, eng, SamplingConfig(temperature=1.2, max_new_tokens=4), [])
    client = TaskPolicyClient(base, 16, set(), seeds=(0, task_id, "actor"))
    other = TaskPolicyClient(base, 16, set())

    async def go() -> list[list[Completion]]:
        noise = [other.generate([1, 9, 9, 18], beside)] if beside else []
        first, *_ = await asyncio.gather(client.generate(PROMPT, 16), *noise)
        return [first, await client.generate(PROMPT, 4)]

    try:
        return asyncio.run(go())
    finally:
        eng.close()


def tokens(calls: list[list[Completion]]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in call] for call in calls]


def test_a_task_samples_the_same_tokens_on_any_engine_beside_any_batch(model_dir: Path) -> None:
    a = run_task(model_dir, engine_seed=1, task_id=7, beside=0)
    b = run_task(model_dir, engine_seed=2, task_id=7, beside=24)
    assert tokens(a) == tokens(b)
    # The same tokens under the same weights: the same logprobs but for the last bits, which CPU matmuls
    # round differently with the number of rows decoded beside them (docs/engine.md).
    lp_a = [lp for call in a for c in call for lp in c.logprobs]
    lp_b = [lp for call in b for c in call for lp in c.logprobs]
    assert len(lp_a) == len(lp_b) and lp_a == pytest.approx(lp_b, abs=1e-5, rel=0)
    group = tokens(a)[0]
    assert len({tuple(t) for t in group}) > 4  # sample i has its own seed: the group is not one sample
    assert tokens(a)[1] != group[:4]  # the second call of the task has a seed of its own
    assert tokens(run_task(model_dir, engine_seed=1, task_id=8, beside=0)) != tokens(a)


def test_an_explicit_seed_wins_over_the_task_seed(model_dir: Path) -> None:
    eng = TorchEngine(str(model_dir), seed=0)
    base = EnginePolicyClient("main", None, eng, SamplingConfig(temperature=1.2, max_new_tokens=4), [])

    async def go(client: TaskPolicyClient) -> list[list[int]]:
        return [list(c.token_ids) for c in await client.generate(PROMPT, 6, seed=12345)]

    try:
        a = asyncio.run(go(TaskPolicyClient(base, 6, set(), seeds=(0, 1, "actor"))))
        b = asyncio.run(go(TaskPolicyClient(base, 6, set(), seeds=(5, 9, "actor"))))
    finally:
        eng.close()
    assert a == b

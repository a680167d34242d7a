"""The collab workflow's long-tailed solver lengths (`solver_tokens_median`): a lognormal budget per
problem, a function of the task and the problem's place alone, that a real engine obeys."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import statistics
from pathlib import Path

import pytest
import torch

from astraflow.config.recipe import SamplingConfig
from astraflow.engines.torch_engine import TorchEngine
from astraflow.models.init import init_model
from astraflow.roles.policy_client import EnginePolicyClient, TaskPolicyClient
from astraflow.workflows.quickstart.collab import CollabConfig, CollabWorkflow, solver_budget

torch.set_num_threads(1)
CAP = 24


def test_the_budget_is_off_by_default_and_a_fixed_draw_when_set() -> None:
    assert solver_budget(CollabConfig(), 5, 0, CAP) is None
    config = CollabConfig(solver_tokens_median=40, solver_tokens_sigma=1.0)
    draws = [solver_budget(config, seed, i, 10_000) for seed in range(250) for i in range(8)]
    assert draws == [solver_budget(config, seed, i, 10_000) for seed in range(250) for i in range(8)]
    values = [d for d in draws if d is not None]
    assert len(values) == 2000
    # a lognormal of median 40, sigma 1: the sample median near 40, a long right tail
    assert 34 <= statistics.median(values) <= 46
    assert max(values) > 8 * 40 and min(values) < 40 / 5
    capped = [solver_budget(config, seed, 0, 50) for seed in range(200)]
    assert all(c is not None and 1 <= c <= 50 for c in capped) and capped.count(50) > 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("collab") / "tiny", seed=0)


def _solver_lengths(
    model_dir: Path,
    options: dict[str, object],
    fill_seed: int,
    task_defaults: dict[str, object] | None = None,
) -> list[list[int]]:
    """Per problem, the lengths of the solver's attempts in one real run_group (no stop token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eng = TorchEngine(str(model_dir), seed=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=CAP)
    base = EnginePolicyClient("p", tok, eng, sampling, [])
    policies = {
        "proposer": TaskPolicyClient(base, 4),
        "solver": TaskPolicyClient(base, 3, defaults=task_defaults),
    }
    wf = CollabWorkflow(CollabConfig(**options))
    sample = {"prompt": "+ =", "fill_seed": fill_seed}
    try:
        episodes = asyncio.run(wf.run_group(sample, policies, {"proposer": 4, "solver": 3}))  # type: ignore[arg-type]
    finally:
        eng.close()
    out = []
    for ep in episodes:
        solver = [s for s in ep.sequences if s.role == "solver"]
        out.append([sum(s.loss_mask) for s in solver])
    return out


def test_the_engine_writes_each_problems_drawn_budget(model_dir: Path) -> None:
    options = {"solver_tokens_median": 6, "solver_tokens_sigma": 1.0}
    lengths = _solver_lengths(model_dir, options, fill_seed=11)
    budgets = [solver_budget(CollabConfig(**options), 11, i, CAP) for i in range(4)]  # type: ignore[arg-type]
    assert lengths == [[b] * 3 for b in budgets]
    assert len(set(budgets)) > 1  # the problems of one task differ
    # off: every attempt writes the recipe's max_new_tokens
    assert _solver_lengths(model_dir, {}, fill_seed=11) == [[CAP] * 3] * 4
    # a task that sets its own max_new_tokens (an evaluation task's) caps the draw instead
    capped = _solver_lengths(model_dir, options, fill_seed=11, task_defaults={"max_new_tokens": 3})
    assert capped == [[min(3, b)] * 3 for b in budgets if b is not None] and max(budgets) > 3  # type: ignore[type-var]

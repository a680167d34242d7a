"""On-policy ratio = 1 under every sampling setting: a real engine samples through the RaaS policy client
(recipe settings and per-call overrides), the sequences go through the buffer's store, and a real
trainer recomputes their logprobs before its first update."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.config.recipe import OptimizerConfig, PolicyConfig, SamplingConfig
from astraflow.dataflow.buffer import Buffer
from astraflow.engines.torch_engine import TorchEngine
from astraflow.models.init import init_model
from astraflow.roles.raas import EnginePolicyClient, TaskPolicyClient, fill_sampling
from astraflow.state.store import Store
from astraflow.trainers.torch_trainer import TorchTrainer
from astraflow.workflows.base import Episode, completion_sequence

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("sampling") / "tiny", seed=0)


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (recipe sampling, per-call override)
    "temperature": ({"temperature": 0.7}, {}),
    "top_p": ({"top_p": 0.6}, {}),
    "top_k": ({"top_k": 5}, {}),
    "all": ({"temperature": 1.3, "top_p": 0.8, "top_k": 12}, {}),
    "override": ({"temperature": 1.2}, {"temperature": 0.5, "top_p": 0.7}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_on_policy_ratio_is_one(model_dir: Path, tmp_path: Path, case: str) -> None:
    sampling, override = CASES[case]
    cfg = SamplingConfig(max_new_tokens=6, **sampling)
    eng = TorchEngine(str(model_dir), seed=3)
    base = EnginePolicyClient("main", None, eng, cfg, stop_ids=[])
    used: dict[str, set[tuple[float, float, int]]] = {}
    client = TaskPolicyClient(base, 4, used.setdefault("main", set()))

    async def go() -> list[Episode]:
        eps = []
        for d in range(4, 12):
            prompt = [1, 14, d, d + 1, 18]
            (c,) = await client.generate(prompt, 1, **override)
            eps.append(Episode(sequences=[completion_sequence(client, prompt, c, reward=float(d % 2))]))
        return eps

    try:
        episodes = asyncio.run(go())
    finally:
        eng.close()
    fill_sampling(episodes, used)
    want = {**sampling, **override}
    seq = episodes[0].sequences[0]
    assert (seq.temperature, seq.top_p, seq.top_k) == (
        want.get("temperature", 1.0),
        want.get("top_p", 1.0),
        want.get("top_k", 0),
    )
    store = Store.open(tmp_path / "s.db")
    store.ensure_policy("main", 1)
    buf = Buffer(store)
    seqs = [ep.sequences[0] for ep in episodes]
    buf.insert(1, "k", seqs, [1.0 if s.reward else -1.0 for s in seqs])
    batch = buf.next_batch("main", 1, len(seqs), 1, 0)
    assert batch is not None and batch.samples[0].temperature == seq.temperature
    # the trainer's recipe says temperature 1.0 and no filters: only the rows' own settings can match
    pol = PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        trainer_options={"micro_batch": 3},
    )
    metrics = TorchTrainer(pol).step(batch.samples)
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-4, metrics
    assert abs(metrics["ratio_max"] - 1.0) < 1e-4, metrics
    assert metrics["approx_kl"] < 1e-7

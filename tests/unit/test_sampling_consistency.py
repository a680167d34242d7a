"""On-policy ratio = 1 under every sampling setting: a real engine samples through the RaaS policy client
(recipe settings and per-call overrides, single-turn and through a multi-turn Transcript), the
sequences carry the SamplingParams the engine reported, go through the buffer's store, and a real
trainer recomputes their logprobs before its first update, also with rows of different settings
packed into one micro-batch."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.config.recipe import OptimizerConfig, PolicyConfig, SamplingConfig
from astraflow.dataflow.buffer import Buffer
from astraflow.engines.torch_engine import TorchEngine
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams, Sequence, TrainSample
from astraflow.roles.policy_client import EnginePolicyClient, TaskPolicyClient
from astraflow.state.store import Store
from astraflow.trainers.torch_trainer import TorchTrainer
from astraflow.workflows.base import completion_sequence
from astraflow.workflows.transcript import Transcript, TranscriptError

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
    "override_top_k": ({"temperature": 0.7}, {"top_k": 5}),
}


def _client(model_dir: Path, eng: TorchEngine, cfg: SamplingConfig, **task: Any) -> TaskPolicyClient:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return TaskPolicyClient(EnginePolicyClient("main", tok, eng, cfg, stop_ids=[]), 4, defaults=task)


def _stored(tmp_path: Path, seqs: list[Sequence]) -> list[TrainSample]:
    """The sequences through the buffer's SQLite store, back as a trainer's batch."""
    store = Store.open(tmp_path / "s.db")
    store.ensure_policy("main", 1)
    buf = Buffer(store)
    buf.insert(1, "k", seqs, [1.0 if i % 2 else -1.0 for i in range(len(seqs))])
    batch = buf.next_batch("main", 1, len(seqs), 1, 0)
    assert batch is not None
    assert Counter(s.sampling for s in batch.samples) == Counter(s.sampling for s in seqs)
    return batch.samples


def _assert_on_policy(
    model_dir: Path, samples: list[TrainSample], micro_batch: int, pack: bool = False
) -> None:
    # the trainer's recipe says temperature 1.0 and no filters: only the rows' own settings can match
    pol = PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        trainer_options={"micro_batch": micro_batch, "pack": pack},
    )
    metrics = TorchTrainer(pol).step(samples)
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        assert abs(metrics[key] - 1.0) < 1e-4, metrics
    assert metrics["approx_kl"] < 1e-7


@pytest.mark.parametrize("case", list(CASES))
def test_on_policy_ratio_is_one(model_dir: Path, tmp_path: Path, case: str) -> None:
    sampling, override = CASES[case]
    cfg = SamplingConfig(max_new_tokens=6, **sampling)
    eng = TorchEngine(str(model_dir), seed=3)
    client = _client(model_dir, eng, cfg)

    async def go() -> list[Sequence]:
        seqs = []
        for d in range(4, 12):
            prompt = [1, 14, d, d + 1, 18]
            (c,) = await client.generate(prompt, 1, **override)
            seqs.append(completion_sequence(client, prompt, c, reward=float(d % 2)))
        return seqs

    try:
        seqs = asyncio.run(go())
    finally:
        eng.close()
    want = {**sampling, **override}
    assert seqs[0].sampling == SamplingParams(**want)
    _assert_on_policy(model_dir, _stored(tmp_path, seqs), micro_batch=3)


def test_multi_turn_top_k_override_reaches_the_trainer(model_dir: Path, tmp_path: Path) -> None:
    """A workflow that overrides top-k on every turn of a Transcript (the recipe has none): the
    Sequence carries top_k from the completions, and the trainer recomputes every turn under it."""
    eng = TorchEngine(str(model_dir), seed=5)
    client = _client(model_dir, eng, SamplingConfig(max_new_tokens=4, temperature=0.7))

    async def episode(d: int) -> Sequence:
        tr = Transcript(client, chat=False)
        tr.add_ids([1, 14, d, 18])
        await tr.generate(top_k=5)
        tr.add_ids([16, d + 1])  # the environment's reply, masked
        await tr.generate(top_k=5, max_new_tokens=3)
        assert len(tr.turns) == 2
        return tr.sequence(float(d % 2))

    async def go() -> list[Sequence]:
        return [await episode(d) for d in range(4, 10)]

    try:
        seqs = asyncio.run(go())
    finally:
        eng.close()
    assert {s.sampling for s in seqs} == {SamplingParams(temperature=0.7, top_k=5)}
    _assert_on_policy(model_dir, _stored(tmp_path, seqs), micro_batch=3)


def test_a_transcript_refuses_a_turn_with_other_settings(model_dir: Path) -> None:
    eng = TorchEngine(str(model_dir), seed=6)
    client = _client(model_dir, eng, SamplingConfig(max_new_tokens=3))

    async def go() -> Transcript:
        tr = Transcript(client, chat=False)
        tr.add_ids([1, 14, 5, 18])
        await tr.generate(top_k=5)
        with pytest.raises(TranscriptError, match="different settings"):
            await tr.generate(top_k=6)
        return tr

    try:
        tr = asyncio.run(go())
    finally:
        eng.close()
    assert len(tr.turns) == 1 and tr.sequence(0.0).sampling.top_k == 5


def test_mixed_settings_in_one_packed_batch(model_dir: Path, tmp_path: Path) -> None:
    """Rows sampled with different settings (plain, top-p, top-k, both, other temperatures) decoded
    together by one engine and trained in one packed micro-batch: each row's ratio is 1."""
    settings = [
        {},
        {"top_p": 0.6},
        {"temperature": 0.6},
        {"top_k": 4},
        {"temperature": 1.4, "top_p": 0.8, "top_k": 9},
        {"top_p": 0.9, "temperature": 0.8},
        {},
        {"top_k": 2},
    ]
    eng = TorchEngine(str(model_dir), seed=7)
    cfg = SamplingConfig(max_new_tokens=6)
    cfg.overrides.top_k = True
    client = _client(model_dir, eng, cfg)

    async def one(i: int, ov: dict[str, Any]) -> Sequence:
        prompt = [1, 14, 4 + i, 18]
        (c,) = await client.generate(prompt, 1, **ov)
        return completion_sequence(client, prompt, c, reward=float(i % 2))

    async def go() -> list[Sequence]:
        # concurrently: the engine decodes the rows in the same batches
        return list(await asyncio.gather(*(one(i, ov) for i, ov in enumerate(settings))))

    try:
        seqs = asyncio.run(go())
    finally:
        eng.close()
    assert [s.sampling for s in seqs] == [SamplingParams(**ov) for ov in settings]
    samples = _stored(tmp_path, seqs)
    # every row in one micro-batch, packed into one row of tokens
    _assert_on_policy(model_dir, samples, micro_batch=len(samples), pack=True)

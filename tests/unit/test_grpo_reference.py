"""The GRPO update is the one TRL's GRPOTrainer takes with loss_type="dapo" (what `astraflow bench trl`
compares against): group advantages (r - mean) / (unbiased std + 1e-5) checked by hand, and the
trainer's gradient on engine-sampled groups equal to that objective written out on a plain
transformers forward (on-policy ratio exp(logp - logp.detach()), clipped term summed over every
completion token of the batch over their count)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.config.recipe import OptimizerConfig, PolicyConfig, SamplingConfig
from astraflow.dataflow.advantages import group_advantages
from astraflow.engines.base import GenerationRequest
from astraflow.engines.torch_engine import TorchEngine
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams, TrainSample
from astraflow.trainers.torch_trainer import TorchTrainer

torch.set_num_threads(1)
TEMP = 1.2
STOP = list(range(4, 12))
"""Half the vocabulary ends a completion, so lengths differ: a token mean and a mean of sequence means
differ."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("grpo-ref") / "tiny", seed=0)


def test_group_advantages_by_hand() -> None:
    # mean 0.25; unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv == pytest.approx(
        [0.75 / 0.50001, -0.25 / 0.50001, -0.25 / 0.50001, -0.25 / 0.50001], rel=1e-12
    )
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]  # no signal, not 0 / 0


def _groups(model_dir: Path) -> list[TrainSample]:
    """Two prompts x 4 samples from the engine at temperature 1.2, rewarded by the first token's parity
    and the length."""
    eng = TorchEngine(str(model_dir), seed=5)
    prompts = [[1, 14, 5, 6, 18], [1, 14, 7, 3, 18, 9]]

    async def go() -> list:
        return await asyncio.gather(
            *[
                eng.generate_n(
                    GenerationRequest(
                        prompt_ids=p,
                        max_new_tokens=4,
                        sampling=SamplingParams(temperature=TEMP),
                        stop_ids=STOP,
                        seed=i,
                    ),
                    4,
                )
                for i, p in enumerate(prompts)
            ]
        )

    try:
        outs = asyncio.run(go())
    finally:
        eng.close()
    batch = []
    for prompt, comps in zip(prompts, outs, strict=True):
        rewards = [float(c.token_ids[0] % 2) + 0.1 * len(c.token_ids) for c in comps]
        for c, r, a in zip(comps, rewards, group_advantages(rewards), strict=True):
            n = len(prompt)
            batch.append(
                TrainSample(
                    traj_id=len(batch),
                    tokens=prompt + c.token_ids,
                    loss_mask=[0] * n + [1] * len(c.token_ids),
                    logprobs=[0.0] * n + c.logprobs,
                    versions=[-1] * n + c.versions,
                    reward=r,
                    advantage=a,
                    sampling=c.sampling,
                )
            )
    return batch


def test_trainer_gradient_is_the_dapo_token_mean_over_the_batch(model_dir: Path) -> None:
    batch = _groups(model_dir)
    assert any(s.advantage != 0 for s in batch)
    assert len({sum(s.loss_mask) for s in batch}) > 1
    pol = PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        sampling=SamplingConfig(temperature=TEMP),
        trainer_options={"micro_batch": 3},  # split over micro-batches: still one token mean
    )
    loss, grads = TorchTrainer(pol).batch_gradients(batch)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    width = max(s.length for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(batch), width - 1)
    for i, s in enumerate(batch):
        ids[i, : s.length] = torch.tensor(s.token_list())
        attn[i, : s.length] = 1
        mask[i, : s.length - 1] = torch.tensor(s.mask_list()[1:], dtype=torch.float32)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / TEMP
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    adv = torch.tensor([s.advantage for s in batch]).unsqueeze(1)
    ratio = torch.exp(logp - logp.detach())
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    ref = (per_token * mask).sum() / mask.sum()
    ref.backward()

    assert loss == pytest.approx(float(ref.detach()), abs=1e-6)
    for name, p in model.named_parameters():
        assert p.grad is not None
        # atol: float32 sums in another order (the micro-batches go by length) differ by an ulp or so
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)

"""The PyTorch trainer: logprob alignment with the engine, gradient accumulation, prox/ref
logprobs, metrics, exported weights and exact resume from a checkpoint."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import random
from pathlib import Path

import pytest
import torch

from astraflow.config.recipe import OptimizerConfig, PolicyConfig, SamplingConfig
from astraflow.engines.base import GenerationRequest
from astraflow.engines.torch_engine import TorchEngine
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams, TrainSample
from astraflow.trainers.torch_trainer import TorchTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("trainer") / "tiny", seed=0)


def _policy(model_dir: Path, **kw: object) -> PolicyConfig:
    base: dict[str, object] = {
        "model": str(model_dir),
        "optimizer": OptimizerConfig(lr=1e-2, weight_decay=0.0),
    }
    base.update(kw)
    return PolicyConfig(**base)  # type: ignore[arg-type]


def _batch(seed: int, n: int = 6) -> list[TrainSample]:
    """Synthetic sequences of different lengths: a prompt (mask 0) then generated tokens (mask 1)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(2, 5))]
        gen = [rng.randrange(4, 19) for _ in range(rng.randrange(1, 5))]
        out.append(
            TrainSample(
                traj_id=i,
                tokens=prompt + gen,
                loss_mask=[0] * len(prompt) + [1] * len(gen),
                logprobs=[0.0] * len(prompt) + [-2.9] * len(gen),
                versions=[-1] * len(prompt) + [rng.choice([0, 0, 1])] * len(gen),
                reward=rng.random(),
                advantage=rng.uniform(-1, 1),
                sampling=SamplingParams(),
            )
        )
    return out


def _on_policy_batch(model_dir: Path, temperature: float) -> list[TrainSample]:
    eng = TorchEngine(str(model_dir), seed=1)

    async def go() -> list:
        reqs = [
            GenerationRequest(
                prompt_ids=[1, 14, d, d + 1, 18],
                max_new_tokens=4,
                sampling=SamplingParams(temperature=temperature),
            )
            for d in range(4, 12)
        ]
        return await eng.generate(reqs)

    try:
        outs = asyncio.run(go())
    finally:
        eng.close()
    batch = []
    for i, (d, c) in enumerate(zip(range(4, 12), outs, strict=True)):
        prompt = [1, 14, d, d + 1, 18]
        batch.append(
            TrainSample(
                traj_id=i,
                tokens=prompt + c.token_ids,
                loss_mask=[0] * 5 + [1] * len(c.token_ids),
                logprobs=[0.0] * 5 + c.logprobs,
                versions=[-1] * 5 + c.versions,
                reward=float(i % 2),
                advantage=1.0 if i % 2 else -1.0,
                sampling=SamplingParams(temperature=temperature),
            )
        )
    return batch


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_trainer_logprobs_equal_engine_logprobs_on_policy(model_dir: Path, temperature: float) -> None:
    batch = _on_policy_batch(model_dir, temperature)
    pol = _policy(
        model_dir, sampling=SamplingConfig(temperature=temperature), trainer_options={"micro_batch": 3}
    )
    metrics = TorchTrainer(pol).step(batch)
    # Before the update the policy is the behaviour policy: every ratio is 1 (shift-by-one is right).
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-4
    assert abs(metrics["ratio_max"] - 1.0) < 1e-4
    assert metrics["approx_kl"] < 1e-8
    # the engine's tokens are version 0's, the version the trainer holds: the mismatch is numerics only
    assert metrics["trainer/mismatch/tokens_fresh"] == sum(sum(s.loss_mask) for s in batch)
    assert metrics["trainer/mismatch/tokens_stale"] == 0
    assert metrics["trainer/mismatch/logp_abs_diff_fresh"] < 1e-4
    assert abs(metrics["trainer/mismatch/ratio_fresh"] - 1.0) < 1e-4


def test_micro_batching_and_padding_do_not_change_the_update(model_dir: Path) -> None:
    batch = _batch(0, n=7)
    whole = TorchTrainer(_policy(model_dir, trainer_options={"micro_batch": 64}))
    pieces = TorchTrainer(_policy(model_dir, trainer_options={"micro_batch": 2}))
    m1, m2 = whole.step(batch), pieces.step(batch)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    # Adam's first step amplifies float noise on near-zero gradients, so compare the gradients.
    g1 = {n: p.grad for n, p in whole.model.named_parameters()}
    g2 = {n: p.grad for n, p in pieces.model.named_parameters()}
    assert all(torch.allclose(g1[n], g2[n], atol=1e-7, rtol=1e-4) for n in g1)
    assert any(float(g.abs().max()) > 1e-3 for g in g1.values())


def test_metrics_and_minibatches(model_dir: Path) -> None:
    batch = _batch(1, n=6)
    trainer = TorchTrainer(_policy(model_dir, minibatches=3, trainer_options={"micro_batch": 1}))
    before = trainer.export_weights()
    metrics = trainer.step(batch)
    assert trainer.step_count == 1
    for key in (
        "loss",
        "grad_norm",
        "entropy",
        "trainer/reward_mean",
        "adv_mean",
        "adv_std",
        "trainer/staleness_mean",
        "trainer/staleness_max",
        "tokens",
        "clip_frac",
        "lr",
    ):
        assert key in metrics and metrics[key] == metrics[key]  # present and not NaN
    assert metrics["tokens"] == sum(sum(s.loss_mask) for s in batch)
    assert metrics["trainer/reward_mean"] == pytest.approx(sum(s.reward for s in batch) / 6)
    # Version 0 trains at step 1; token versions 0/1 give staleness 0 (and -1 for "newer").
    assert metrics["trainer/staleness_max"] <= 0.0
    # Later minibatches see moved parameters, so some ratios leave 1.
    assert metrics["ratio_max"] != pytest.approx(1.0, abs=1e-7) or metrics["ratio_min"] != pytest.approx(
        1.0, abs=1e-7
    )
    after = trainer.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_positive_advantage_raises_the_sequence_logprob(model_dir: Path) -> None:
    import msgspec

    from astraflow.trainers.torch_trainer import token_logprobs

    good = msgspec.structs.replace(_batch(2, n=1)[0], advantage=1.0)
    trainer = TorchTrainer(_policy(model_dir))
    tokens = torch.tensor([good.token_list()])
    attn = torch.ones_like(tokens)
    mask = torch.tensor([good.mask_list()[1:]], dtype=torch.float32)
    with torch.no_grad():
        start = float((token_logprobs(trainer.model, tokens, attn) * mask).sum())
    for _ in range(3):
        trainer.step([good])
    with torch.no_grad():
        end = float((token_logprobs(trainer.model, tokens, attn) * mask).sum())
    assert end > start


def test_exported_weights_are_detached_cpu_copies(model_dir: Path) -> None:
    trainer = TorchTrainer(_policy(model_dir))
    exported = trainer.export_weights()
    snapshot = {k: v.clone() for k, v in exported.items()}
    trainer.step(_batch(3))
    assert all(v.device.type == "cpu" and not v.requires_grad for v in exported.values())
    assert all(torch.equal(exported[k], snapshot[k]) for k in exported)
    assert "lm_head.weight" in exported and "model.embed_tokens.weight" in exported


def test_prox_and_ref_logprobs_are_supplied(model_dir: Path) -> None:
    for loss, options in (("decoupled_ppo", {}), ("grpo", {"kl_coef": 0.1})):
        trainer = TorchTrainer(_policy(model_dir, loss=loss, loss_options=options))
        metrics = trainer.step(_batch(4))
        assert metrics["loss"] == metrics["loss"]
    assert trainer.ref_model is not None
    assert "kl" in metrics


def test_checkpoint_resume_is_exact(model_dir: Path, tmp_path: Path) -> None:
    pol = _policy(model_dir, minibatches=2, optimizer=OptimizerConfig(lr=1e-2, warmup_steps=3))
    batches = [_batch(10 + i) for i in range(4)]
    straight = TorchTrainer(pol, seed=5)
    for b in batches:
        straight.step(b)

    first = TorchTrainer(pol, seed=5)
    for b in batches[:2]:
        first.step(b)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = TorchTrainer(pol, seed=5)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step_count == 2
    for b in batches[2:]:
        resumed.step(b)
    a, b = straight.export_weights(), resumed.export_weights()
    assert resumed.step_count == straight.step_count == 4
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    from astraflow.errors import AstraflowError

    with pytest.raises(AstraflowError) as exc:
        TorchTrainer(_policy(tmp_path / "nope"))
    assert "model init" in exc.value.hint

"""PPO with GAE: per-token GAE and the clipped value loss against values worked out by hand, the `gae`
estimator's group stage and options, per-token advantages through the token-level objectives, and the
value model in the real PyTorch trainer (it learns, and resumes exactly from a checkpoint)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import math
import random
from pathlib import Path

import pytest
import torch

from astraflow.config.recipe import OptimizerConfig, PolicyConfig
from astraflow.dataflow.estimators import GAEConfig, make_estimator
from astraflow.errors import AstraflowError, PluginError, RecipeError
from astraflow.losses.base import LossInputs
from astraflow.losses.grpo import GRPOLoss
from astraflow.losses.gspo import GSPOLoss
from astraflow.losses.value import clipped_value_loss, explained_variance, gae, whiten
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams, TrainSample
from astraflow.trainers.torch_trainer import TorchTrainer

torch.set_num_threads(1)


def test_gae_worked_example() -> None:
    # Row 0: trained tokens at 1, 2 and 4 (3 is a tool result, masked), values 0.5, 0.2, 0.8 there;
    # the 9s sit on untrained positions and must not count. gamma 0.9, lambda 0.8, reward 1:
    #   k=4: delta = 1 + 0 - 0.8 = 0.2                      A = 0.2
    #   k=2: delta = 0 + 0.9 * 0.8 - 0.2 = 0.52             A = 0.52 + 0.72 * 0.2 = 0.664
    #   k=1: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32            A = -0.32 + 0.72 * 0.664 = 0.15808
    # Row 1: nothing trained. Row 2: one trained token, value 0.3, reward -1: A = -1.3.
    values = torch.tensor([[9.0, 0.5, 0.2, 9.0, 0.8], [1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.3, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[0.0, 1, 1, 0, 1], [0.0, 0, 0, 0, 0], [0.0, 1, 0, 0, 0]])
    rewards = torch.tensor([1.0, 5.0, -1.0])
    adv, ret = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    want = torch.tensor([[0, 0.15808, 0.664, 0, 0.2], [0.0] * 5, [0, -1.3, 0, 0, 0]])
    assert torch.allclose(adv, want, atol=1e-6)
    assert torch.allclose(
        ret, torch.tensor([[0, 0.65808, 0.864, 0, 1.0], [0.0] * 5, [0, -1.0, 0, 0, 0]]), atol=1e-6
    )
    # gamma = lambda = 1: every token's advantage is R - V (the Monte-Carlo return minus the value)
    adv1, ret1 = gae(values, rewards, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv1[0], torch.tensor([0, 0.5, 0.8, 0, 0.2]), atol=1e-6)
    assert torch.allclose(ret1[0], torch.tensor([0, 1.0, 1.0, 0, 1.0]), atol=1e-6)
    # lambda = 0: one-step TD errors
    adv0, _ = gae(values, rewards, mask, gamma=0.9, lam=0.0)
    assert torch.allclose(adv0[0], torch.tensor([0, -0.32, 0.52, 0, 0.2]), atol=1e-6)


def test_whiten_over_micro_batches_by_hand() -> None:
    # trained values 1, 3 | 5, 7 -> mean 4, population std sqrt(5)
    a = [torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[5.0, 7.0]])]
    m = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0]])]
    out = whiten(a, m)
    s = math.sqrt(5.0)
    assert torch.allclose(out[0], torch.tensor([[-3 / s, -1 / s, 0.0]]), atol=1e-6)
    assert torch.allclose(out[1], torch.tensor([[1 / s, 3 / s]]), atol=1e-6)
    same = whiten([torch.tensor([[2.0, 2.0]])], [torch.ones(1, 2)])
    assert torch.equal(same[0], torch.zeros(1, 2))


def test_clipped_value_loss_by_hand() -> None:
    # token 0: old 0, new 0.5, return 1, clip 0.2 -> plain 0.25, clipped (0.2 - 1)^2 = 0.64: the max is
    #          the clipped branch, whose value is constant in V (no gradient);
    # token 1: old 0, new 0.1, return 1 -> both 0.81, gradient (0.1 - 1) / tokens;
    # token 2: old 0, new -0.5, return 0.5 -> plain 1.0, clipped (-0.2 - 0.5)^2 = 0.49: plain wins;
    # token 3: masked out.
    v = torch.tensor([[0.5, 0.1, -0.5, 3.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    ret = torch.tensor([[1.0, 1.0, 0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = clipped_value_loss(v, old, ret, mask, clip=0.2, total_tokens=3)
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 0.81 + 1.0) / 3, abs=1e-6)
    loss.backward()
    assert v.grad is not None
    assert v.grad.tolist()[0] == pytest.approx([0.0, (0.1 - 1.0) / 3, (-0.5 - 0.5) / 3, 0.0], abs=1e-6)
    assert metrics["value_clip_frac"] == pytest.approx(1 / 3)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)


def test_gae_estimator_passes_rewards_and_checks_options() -> None:
    est = make_estimator("gae", {"gamma": 0.99, "lam": 0.9})
    assert isinstance(est.config, GAEConfig) and est.config.lam == 0.9 and est.config.whiten
    assert est.group([1.0, 0.0, 0.5]) == [1.0, 0.0, 0.5]
    assert not est.batch_level
    with pytest.raises(ValueError):
        est.group([1.0, math.inf])
    with pytest.raises(RecipeError, match="lam"):
        make_estimator("gae", {"lam": 1.5})
    with pytest.raises(RecipeError, match="gama"):
        make_estimator("gae", {"gama": 0.9})


def test_token_level_objectives_take_per_token_advantages() -> None:
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=g) * 0.1 - 1.0).requires_grad_(True)
    beh = logp.detach() + torch.randn(3, 4, generator=g) * 0.1
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    seq_adv = torch.tensor([0.5, -1.0, 2.0])
    grpo = GRPOLoss()
    a, _ = grpo(LossInputs(logp=logp, behaviour_logp=beh, mask=mask, advantages=seq_adv))
    b, _ = grpo(
        LossInputs(logp=logp, behaviour_logp=beh, mask=mask, advantages=seq_adv[:, None].expand(3, 4))
    )
    assert float(a.detach()) == pytest.approx(float(b.detach()), abs=1e-7)
    # a different advantage on one token changes only that token's term
    tok = seq_adv[:, None].expand(3, 4).clone()
    tok[1, 2] = 3.0
    c, _ = grpo(LossInputs(logp=logp, behaviour_logp=beh, mask=mask, advantages=tok))
    assert float(c.detach()) != pytest.approx(float(a.detach()), abs=1e-6)
    with pytest.raises(PluginError, match="sequence-level"):
        GSPOLoss()(LossInputs(logp=logp, behaviour_logp=beh, mask=mask, advantages=tok))
    with pytest.raises(PluginError, match="advantages have shape"):
        grpo(LossInputs(logp=logp, behaviour_logp=beh, mask=mask, advantages=torch.zeros(3, 2)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("gae") / "tiny", seed=0)


def _policy(model_dir: Path, **options: object) -> PolicyConfig:
    return PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        advantage="gae",
        advantage_options={"critic_lr": 3e-3, **options},
        minibatches=2,
    )


def _batch(seed: int, n: int = 6) -> list[TrainSample]:
    """A prompt (mask 0), generated tokens (mask 1), a reward that depends on the first prompt token."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1, 4 + i % 2] + [rng.randrange(6, 19) for _ in range(2)]
        gen = [rng.randrange(4, 19) for _ in range(rng.randrange(2, 5))]
        out.append(
            TrainSample(
                traj_id=i,
                tokens=prompt + gen,
                loss_mask=[0] * len(prompt) + [1] * len(gen),
                logprobs=[0.0] * len(prompt) + [-2.9] * len(gen),
                versions=[-1] * len(prompt) + [0] * len(gen),
                reward=float(i % 2),
                advantage=float(i % 2),
                sampling=SamplingParams(),
            )
        )
    return out


def test_trainer_value_model_learns_the_returns(model_dir: Path) -> None:
    trainer = TorchTrainer(_policy(model_dir), seed=3)
    assert trainer.critic is not None
    batch = _batch(0)
    first = trainer.step(batch)
    for name in ("value_loss", "value_explained_var", "returns_mean", "value_clip_frac", "adv_std"):
        assert name in first, name
    # zero-initialised head: every first value is 0, so the first loss is 0.5 * mean(return^2)
    assert first["values_mean"] == 0.0
    for _ in range(12):
        last = trainer.step(batch)
    assert last["value_loss"] < 0.5 * first["value_loss"], (first, last)
    assert last["value_explained_var"] > 0.3, last


def test_trainer_with_value_model_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    pol = _policy(model_dir, gamma=0.95)
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
    for b in batches[2:]:
        resumed.step(b)
    a, b = straight.export_weights(), resumed.export_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.critic is not None and resumed.critic is not None
    ca, cb = straight.critic.state_dict(), resumed.critic.state_dict()
    assert all(torch.equal(ca[k], cb[k]) for k in ca)
    # the policy's weights alone do not resume a gae run
    plain = TorchTrainer(PolicyConfig(model=str(model_dir)), seed=5)
    plain.save_checkpoint(tmp_path / "plain")
    with pytest.raises(AstraflowError, match="no value model"):
        TorchTrainer(pol, seed=5).load_checkpoint(tmp_path / "plain")

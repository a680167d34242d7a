"""Group advantages and the GRPO objective against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.dataflow.advantages import group_advantages
from astraflow.losses.base import LossInputs
from astraflow.losses.grpo import GRPOConfig, GRPOLoss

torch.set_num_threads(1)


def test_grpo_advantages_by_hand() -> None:
    # mean 0.5, unbiased std sqrt(1/3): advantages are +-0.5 / (0.57735 + 1e-5).
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-5)
    assert adv == pytest.approx([expected, -expected, -expected, expected], abs=1e-12)
    assert group_advantages([0.75, 0.25], "grpo") == pytest.approx(
        [0.25 / (math.sqrt(0.125) + 1e-5), -0.25 / (math.sqrt(0.125) + 1e-5)]
    )


def test_drgrpo_and_degenerate_groups() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "drgrpo") == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([0.7]) == [0.0]
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_advantages([]) == []
    with pytest.raises(ValueError):
        group_advantages([1.0], "ppo")


def _inputs(total_tokens: float | None = None, rows: slice = slice(None)) -> LossInputs:
    # Row 0: ratios 1.5 and 0.5 with A = +1; row 1: ratio 1.1 with A = -1, then a padded token.
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), 5.0]], dtype=torch.float64)
    logp = log_ratio[rows].clone().requires_grad_(True)
    return LossInputs(
        logp=logp,
        behaviour_logp=torch.zeros_like(logp),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)[rows],
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64)[rows],
        total_tokens=total_tokens,
    )


def test_grpo_loss_gradient_and_clip_fraction_by_hand() -> None:
    inputs = _inputs()
    loss, metrics = GRPOLoss(GRPOConfig(clip_low=0.2, clip_high=0.2))(inputs)
    # min(1.5, 1.2) + min(0.5, 0.8) + min(-1.1, -1.1) = 0.6 over 3 tokens.
    assert float(loss.detach()) == pytest.approx(-0.2, abs=1e-12)
    loss.backward()
    grad = inputs.logp.grad
    assert grad is not None
    # The clipped token and the padded token get no gradient; the others get -r * A / 3.
    expected = torch.tensor([[0.0, -0.5 / 3], [1.1 / 3, 0.0]], dtype=torch.float64)
    assert torch.allclose(grad, expected, atol=1e-12)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_micro_batch_losses_add_up_to_the_batch_token_mean() -> None:
    loss_fn = GRPOLoss()
    whole, _ = loss_fn(_inputs())
    part0, _ = loss_fn(_inputs(total_tokens=3.0, rows=slice(0, 1)))
    part1, _ = loss_fn(_inputs(total_tokens=3.0, rows=slice(1, 2)))
    assert float((part0 + part1).detach()) == pytest.approx(float(whole.detach()), abs=1e-12)
    halved, _ = loss_fn(_inputs(total_tokens=6.0))
    assert float(halved.detach()) == pytest.approx(-0.1, abs=1e-12)

"""Decoupled PPO and TIS: clipping against pi_prox / pi_old and the behaviour importance weight, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.errors import PluginError
from astraflow.losses.base import LossInputs
from astraflow.losses.decoupled_ppo import DecoupledPPOConfig, DecoupledPPOLoss
from astraflow.losses.tis import TISConfig, TISLoss

torch.set_num_threads(1)

# log(pi / pi_prox) and log(pi_prox / pi_behaviour) per token; row 1's last token is padding.
CUR_VS_PROX = [[0.3, 0.0], [-0.1, 3.0]]
PROX_VS_BEHAV = [[0.5, -1.0], [2.0, 3.0]]
MASK = [[1.0, 1.0], [1.0, 0.0]]
ADV = [1.0, -1.0]


def _inputs(**extra: object) -> LossInputs:
    behaviour = torch.zeros(2, 2, dtype=torch.float64)
    prox = torch.tensor(PROX_VS_BEHAV, dtype=torch.float64)
    logp = (prox + torch.tensor(CUR_VS_PROX, dtype=torch.float64)).requires_grad_()
    return LossInputs(
        logp=logp,
        behaviour_logp=behaviour,
        mask=torch.tensor(MASK, dtype=torch.float64),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        prox_logp=prox,
        **extra,  # type: ignore[arg-type]
    )


def test_decoupled_ppo_needs_prox_and_matches_hand_value() -> None:
    loss_fn = DecoupledPPOLoss()
    assert loss_fn.needs_prox is True and loss_fn.needs_ref is False
    inputs = _inputs()
    loss, metrics = loss_fn(inputs)
    # token (0,0): r = e^.3 > 1.2 with A > 0 -> clipped at 1.2, weight e^.5; (0,1): r = 1, weight e^-1;
    # (1,0): r = e^-.1 inside the range, A = -1, weight e^2.
    terms = [math.exp(0.5) * 1.2, math.exp(-1.0) * 1.0, math.exp(2.0) * -math.exp(-0.1)]
    assert loss.item() == pytest.approx(-sum(terms) / 3)
    loss.backward()
    grad = inputs.logp.grad
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-math.exp(-1.0) / 3)
    assert grad[1, 0].item() == pytest.approx(math.exp(2.0) * math.exp(-0.1) / 3)
    assert grad[1, 1].item() == 0.0
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    assert metrics["is_weight_max"] == pytest.approx(math.exp(2.0))
    assert metrics["is_weight_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1.0) + math.exp(2.0)) / 3)
    assert metrics["is_weight_capped_frac"] == 0.0


@pytest.mark.parametrize(("mode", "capped_weight"), [("truncate", 3.0), ("mask", 0.0)])
def test_decoupled_ppo_weight_cap(mode: str, capped_weight: float) -> None:
    loss_fn = DecoupledPPOLoss(DecoupledPPOConfig(weight_cap=3.0, cap_mode=mode))  # type: ignore[arg-type]
    inputs = _inputs()
    loss, metrics = loss_fn(inputs)
    terms = [math.exp(0.5) * 1.2, math.exp(-1.0), capped_weight * -math.exp(-0.1)]
    assert loss.item() == pytest.approx(-sum(terms) / 3)
    assert metrics["is_weight_capped_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert inputs.logp.grad[1, 0].item() == pytest.approx(capped_weight * math.exp(-0.1) / 3)


def test_decoupled_ppo_without_prox_is_a_clear_error() -> None:
    inputs = _inputs()
    inputs.prox_logp = None
    with pytest.raises(PluginError, match="prox"):
        DecoupledPPOLoss()(inputs)


def test_tis_truncates_the_mismatch_weight_at_the_cap() -> None:
    loss_fn = TISLoss()
    assert loss_fn.needs_prox is True and TISConfig().cap == 2.0
    inputs = _inputs()
    loss, metrics = loss_fn(inputs)
    weights = [min(math.exp(0.5), 2.0), min(math.exp(-1.0), 2.0), min(math.exp(2.0), 2.0)]
    terms = [weights[0] * 1.2, weights[1] * 1.0, weights[2] * -math.exp(-0.1)]
    assert loss.item() == pytest.approx(-sum(terms) / 3)
    assert metrics["is_weight_max"] == pytest.approx(2.0)
    assert metrics["is_weight_capped_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # The weight is a detached multiplier: the gradient is w * d(surrogate), nothing through w.
    assert inputs.logp.grad[1, 0].item() == pytest.approx(2.0 * math.exp(-0.1) / 3)
    assert inputs.logp.grad[0, 0].item() == 0.0


def test_tis_without_prox_uses_detached_current_logprobs() -> None:
    loss_fn = TISLoss(TISConfig(use_prox=False, cap=5.0))
    assert loss_fn.needs_prox is False
    inputs = _inputs()
    inputs.prox_logp = None
    loss, metrics = loss_fn(inputs)
    # r = 1 everywhere; w = min(pi / pi_behaviour, 5) with log(pi / pi_behaviour) = .8, -1, 1.9 (e^1.9 > 5).
    weights = [math.exp(0.8), math.exp(-1.0), 5.0]
    assert loss.item() == pytest.approx(-(weights[0] - weights[2] + weights[1]) / 3)
    assert metrics["clip_frac"] == 0.0 and metrics["is_weight_capped_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert inputs.logp.grad[torch.tensor(MASK) > 0].tolist() == pytest.approx(
        [-weights[0] / 3, -weights[1] / 3, weights[2] / 3]
    )

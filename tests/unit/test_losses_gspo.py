"""GSPO: sequence-level ratio (geometric mean of token ratios) with sequence clipping, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.losses.base import LossInputs
from astraflow.losses.gspo import GSPOConfig, GSPOLoss

torch.set_num_threads(1)


def _inputs(
    log_ratio: list[list[float]], mask: list[list[float]], adv: list[float], **extra: object
) -> LossInputs:
    return LossInputs(
        logp=torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True),
        behaviour_logp=torch.zeros(len(log_ratio), len(log_ratio[0]), dtype=torch.float64),
        mask=torch.tensor(mask, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        **extra,  # type: ignore[arg-type]
    )


def test_published_clip_range_is_the_default() -> None:
    cfg = GSPOConfig()
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)


def test_gspo_hand_computed_value_and_gradient() -> None:
    # Row 0: s = exp(mean(0.001, 0, -0.0004)) = exp(0.0002), inside [1 - 3e-4, 1 + 4e-4]: gradient flows.
    # Row 1: s = exp(mean(0.003, 0.001)) = exp(0.002) > 1 + 4e-4 with A > 0: clipped, no gradient.
    inputs = _inputs([[0.001, 0.0, -0.0004], [0.003, 0.001, 7.0]], [[1, 1, 1], [1, 1, 0]], [1.0, 2.0])
    loss, metrics = GSPOLoss()(inputs)
    s0, s1 = math.exp(0.0002), math.exp(0.002)
    expected = -(min(s0 * 1.0, s0) + min(s1 * 2.0, (1 + 4e-4) * 2.0)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # d s_i / d logp_it = s_i / |y_i|, so each token of row 0 gets -A * s0 / 3 / (2 sequences).
    assert inputs.logp.grad[0].tolist() == pytest.approx([-s0 / 3 / 2] * 3)
    assert inputs.logp.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["ratio_max"] == pytest.approx(s1)
    assert metrics["ratio_min"] == pytest.approx(s0)


def test_gspo_negative_advantage_keeps_the_pessimistic_branch() -> None:
    inputs = _inputs([[0.002, 0.002]], [[1, 1]], [-1.0])
    loss, metrics = GSPOLoss()(inputs)
    s = math.exp(0.002)
    assert loss.item() == pytest.approx(s)  # -min(-s, -(1 + 4e-4)) = s: unclipped, still learns
    assert metrics["clip_frac"] == 0.0
    loss.backward()
    assert inputs.logp.grad[0].tolist() == pytest.approx([s / 2, s / 2])


def test_gspo_singleton_sequence_is_its_token_ratio_and_total_sequences_scales() -> None:
    inputs = _inputs([[0.0001], [-0.0002]], [[1], [1]], [1.0, 1.0], total_sequences=8.0)
    loss, _ = GSPOLoss()(inputs)
    assert loss.item() == pytest.approx(-(math.exp(0.0001) + math.exp(-0.0002)) / 8)


def test_gspo_skips_sequences_without_trained_tokens() -> None:
    inputs = _inputs([[0.0001, 0.0], [5.0, 5.0]], [[1, 0], [0, 0]], [1.0, 100.0])
    loss, metrics = GSPOLoss()(inputs)
    assert loss.item() == pytest.approx(-math.exp(0.0001))
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.0001))

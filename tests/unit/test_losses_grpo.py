"""GRPO, DAPO and Dr.GRPO against hand-computed values; the KL term; GRPO's invariance to padding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astraflow.errors import PluginError
from astraflow.losses.base import LossInputs
from astraflow.losses.dapo import DAPOConfig, DAPOLoss
from astraflow.losses.drgrpo import DrGRPOConfig, DrGRPOLoss
from astraflow.losses.grpo import GRPOConfig, GRPOLoss

torch.set_num_threads(1)

# Log ratios of a 2x3 batch; the last token of row 1 is padding (garbage logp, mask 0).
LOG_RATIO = [[0.3, -0.3, 0.0], [-0.5, 0.1, 9.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [1.0, -2.0]


def _inputs(**extra: object) -> LossInputs:
    logp = torch.tensor(LOG_RATIO, dtype=torch.float64, requires_grad=True)
    return LossInputs(
        logp=logp,
        behaviour_logp=torch.zeros(2, 3, dtype=torch.float64),
        mask=torch.tensor(MASK, dtype=torch.float64),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        **extra,  # type: ignore[arg-type]
    )


def _clipped_terms(lo: float, hi: float) -> tuple[list[float], list[float], list[bool]]:
    """Per trained token: min(r A, clip(r) A), d objective / d logp, and whether the clip is active."""
    terms, grads, clipped = [], [], []
    for row, adv in zip(range(2), ADV, strict=True):
        for col in range(3):
            if MASK[row][col] == 0:
                continue
            r = math.exp(LOG_RATIO[row][col])
            unclipped, clip = r * adv, min(max(r, 1 - lo), 1 + hi) * adv
            terms.append(min(unclipped, clip))
            clipped.append(clip < unclipped)
            grads.append(0.0 if clip < unclipped else r * adv)
    return terms, grads, clipped


def test_grpo_matches_hand_computed_value_and_gradient() -> None:
    terms, grads, clipped = _clipped_terms(0.2, 0.2)
    inputs = _inputs()
    loss, metrics = GRPOLoss()(inputs)
    assert loss.item() == pytest.approx(-sum(terms) / 5)
    loss.backward()
    got = inputs.logp.grad[torch.tensor(MASK) > 0].tolist()
    assert got == pytest.approx([-g / 5 for g in grads])
    # r = e^0.3 with A > 0 and r = e^-0.5 with A < 0 sit outside the range: no gradient there.
    assert clipped == [True, False, False, True, False]
    assert inputs.logp.grad[1, 2].item() == 0.0
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.3))
    assert metrics["ratio_min"] == pytest.approx(math.exp(-0.5))
    assert metrics["ratio_mean"] == pytest.approx(sum(math.exp(x) for x in [0.3, -0.3, 0.0, -0.5, 0.1]) / 5)
    assert "kl" not in metrics and "entropy" not in metrics


def test_grpo_total_tokens_sets_the_denominator() -> None:
    terms, _, _ = _clipped_terms(0.2, 0.2)
    loss, _ = GRPOLoss()(_inputs(total_tokens=20.0))
    assert loss.item() == pytest.approx(-sum(terms) / 20)


def test_dapo_clips_higher_by_default() -> None:
    cfg = DAPOConfig()
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28)
    terms, _, _ = _clipped_terms(0.2, 0.28)
    loss, metrics = DAPOLoss()(_inputs())
    assert loss.item() == pytest.approx(-sum(terms) / 5)
    # e^0.3 = 1.35 is still above 1.28, so the same two tokens are clipped, at a different value.
    assert terms[0] == pytest.approx(1.28)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)


def test_drgrpo_divides_the_token_sum_by_a_constant() -> None:
    terms, grads, _ = _clipped_terms(0.2, 0.2)
    loss, _ = DrGRPOLoss(DrGRPOConfig(max_tokens=4))(_inputs())
    assert loss.item() == pytest.approx(-sum(terms) / (4 * 2))
    loss, _ = DrGRPOLoss(DrGRPOConfig(max_tokens=4))(_inputs(total_sequences=8.0, total_tokens=99.0))
    assert loss.item() == pytest.approx(-sum(terms) / (4 * 8))
    inputs = _inputs()
    loss, _ = DrGRPOLoss()(inputs)  # padded width T = 3 stands in for the budget
    assert loss.item() == pytest.approx(-sum(terms) / (3 * 2))
    loss.backward()
    assert inputs.logp.grad[torch.tensor(MASK) > 0].tolist() == pytest.approx([-g / 6 for g in grads])


def test_drgrpo_does_not_normalise_by_length() -> None:
    """A longer answer with the same per-token terms weighs more under Dr.GRPO, not under GRPO."""
    short = LossInputs(
        logp=torch.zeros(1, 4, dtype=torch.float64),
        behaviour_logp=torch.zeros(1, 4, dtype=torch.float64),
        mask=torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64),
        advantages=torch.ones(1, dtype=torch.float64),
    )
    long = LossInputs(
        short.logp, short.behaviour_logp, torch.ones(1, 4, dtype=torch.float64), short.advantages
    )
    assert GRPOLoss()(short)[0].item() == pytest.approx(GRPOLoss()(long)[0].item())
    dr = DrGRPOLoss(DrGRPOConfig(max_tokens=4))
    assert dr(long)[0].item() == pytest.approx(2 * dr(short)[0].item())


def test_k3_kl_term_hand_computed_and_needs_ref_follows_coef() -> None:
    assert GRPOLoss().needs_ref is False
    loss_fn = GRPOLoss(GRPOConfig(kl_coef=0.1))
    assert loss_fn.needs_ref is True and loss_fn.needs_prox is False
    ref = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]], dtype=torch.float64)
    inputs = _inputs(ref_logp=ref)
    loss, metrics = loss_fn(inputs)
    terms, _, _ = _clipped_terms(0.2, 0.2)
    k3 = []
    for row in range(2):
        for col in range(3):
            if MASK[row][col]:
                d = ref[row, col].item() - LOG_RATIO[row][col]
                k3.append(math.exp(d) - d - 1)
    assert loss.item() == pytest.approx(-sum(terms) / 5 + 0.1 * sum(k3) / 5)
    assert metrics["kl"] == pytest.approx(sum(k3) / 5)
    # k3 gradient w.r.t. logp is 1 - exp(ref - logp); on a clipped token only the KL part remains.
    loss.backward()
    d0 = ref[0, 0].item() - 0.3
    assert inputs.logp.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(d0)) / 5)


def test_kl_without_ref_logprobs_is_a_clear_error() -> None:
    with pytest.raises(PluginError, match="reference"):
        GRPOLoss(GRPOConfig(kl_coef=0.001))(_inputs())


def test_entropy_metric_and_shape_check() -> None:
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]], dtype=torch.float64)
    _, metrics = GRPOLoss()(_inputs(entropy=ent))
    assert metrics["entropy"] == pytest.approx(15.0 / 5)
    with pytest.raises(PluginError, match="ref_logp"):
        GRPOLoss()(_inputs(ref_logp=torch.zeros(2, 2, dtype=torch.float64)))


def test_config_rejects_unknown_options() -> None:
    with pytest.raises(ValueError):
        GRPOConfig.model_validate({"clip_lo": 0.1})
    assert DrGRPOConfig.model_validate({"max_tokens": 64, "kl_coef": 0.001}).max_tokens == 64


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 5),
    pad=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    kl=st.booleans(),
)
def test_grpo_is_invariant_to_padding(rows: int, cols: int, pad: int, seed: int, kl: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    behaviour = logp + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.rand(rows, cols, generator=gen) > 0.3).double()
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    loss_fn = GRPOLoss(GRPOConfig(kl_coef=0.05 if kl else 0.0))

    def run(extra: int) -> tuple[float, torch.Tensor]:
        # Padding carries garbage, including values that would overflow exp() if they leaked in.
        junk = torch.full((rows, extra), 50.0, dtype=torch.float64)
        lp = torch.cat([logp, -junk], dim=1).requires_grad_()
        inputs = LossInputs(
            logp=lp,
            behaviour_logp=torch.cat([behaviour, junk], dim=1),
            mask=torch.cat([mask, torch.zeros(rows, extra, dtype=torch.float64)], dim=1),
            advantages=adv,
            ref_logp=torch.cat([ref, junk], dim=1),
        )
        loss, _ = loss_fn(inputs)
        loss.backward()
        return loss.item(), lp.grad

    base_loss, base_grad = run(0)
    pad_loss, pad_grad = run(pad)
    assert math.isfinite(pad_loss)
    assert pad_loss == pytest.approx(base_loss, abs=1e-12)
    assert torch.allclose(pad_grad[:, :cols], base_grad, atol=1e-12)
    assert torch.all(pad_grad[:, cols:] == 0)

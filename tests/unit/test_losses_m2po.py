"""M2PO: the second-moment mask by hand, batch versus minibatch scope, and its properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astraflow.losses.base import LossInputs
from astraflow.losses.m2po import M2POConfig, M2POLoss, second_moment_cut

torch.set_num_threads(1)

LOG_RATIO = [[0.3, -0.05, 0.0, 0.1], [0.02, 4.0, 4.0, 4.0]]
MASK = [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
ADV = [1.0, -1.0]


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


def test_m2po_hand_computed_mask_value_gradient_and_metrics() -> None:
    # (log r)^2 = .09, .0025, 0, .01, .0004: mean .02058 > .01; without .09 the mean is .003225 <= .01.
    inputs = _inputs(LOG_RATIO, MASK, ADV)
    loss, metrics = M2POLoss()(inputs)
    kept = math.exp(-0.05) + 1.0 + math.exp(0.1) - math.exp(0.02)
    assert loss.item() == pytest.approx(-kept / 5)  # token mean over all 5 trained tokens
    loss.backward()
    grad = inputs.logp.grad
    assert grad[0, 0].item() == 0.0  # the masked token
    assert grad[0, 1].item() == pytest.approx(-math.exp(-0.05) / 5)  # no clipping: -A r / N
    assert grad[1, 0].item() == pytest.approx(math.exp(0.02) / 5)
    assert metrics["m2po_masked_frac"] == pytest.approx(0.2)
    assert metrics["m2po_m2_before"] == pytest.approx(0.1029 / 5)
    assert metrics["m2po_m2_after"] == pytest.approx(0.0129 / 4)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.3))


def test_m2po_smaller_tau_masks_more() -> None:
    _, metrics = M2POLoss(M2POConfig(tau=0.001))(_inputs(LOG_RATIO, MASK, ADV))
    # Without .09 and .01 the rest (.0025, 0, .0004) has mean .00097 <= .001.
    assert metrics["m2po_masked_frac"] == pytest.approx(0.4)
    assert metrics["m2po_m2_after"] == pytest.approx(0.0029 / 3)


def test_m2po_no_masking_when_within_the_bound() -> None:
    inputs = _inputs([[0.05, -0.05]], [[1, 1]], [1.0])
    loss, metrics = M2POLoss()(inputs)
    assert metrics["m2po_masked_frac"] == 0.0
    assert loss.item() == pytest.approx(-(math.exp(0.05) + math.exp(-0.05)) / 2)


def test_batch_scope_uses_the_cut_prepared_over_the_whole_batch() -> None:
    # Whole batch: one token with (log r)^2 = .0225 among four zeros: mean .0045 <= .01, nothing masked.
    # The minibatch holding only that token alone exceeds tau and would be masked on its own.
    # Micro-batches of one step may have different padded widths.
    other = _inputs([[0.0, 0.0, 0.0, 0.0, 0.0]], [[1, 1, 1, 1, 0]], [1.0])
    mini = _inputs([[0.15, 0.0, 0.0]], [[1, 0, 0]], [1.0], total_tokens=5.0)
    batch = M2POLoss()
    batch.prepare([other, mini])
    loss, metrics = batch(mini)
    assert metrics["m2po_masked_frac"] == 0.0
    assert loss.item() == pytest.approx(-math.exp(0.15) / 5)
    per_call = M2POLoss(M2POConfig(scope="minibatch"))
    per_call.prepare([other, mini])
    loss, metrics = per_call(mini)
    assert metrics["m2po_masked_frac"] == 1.0
    assert loss.item() == 0.0
    # Without prepare() the batch scope falls back to the minibatch it is given.
    assert M2POLoss()(mini)[1]["m2po_masked_frac"] == 1.0


def test_prepare_prefers_proximal_logprobs() -> None:
    full = _inputs([[0.0, 0.0]], [[1, 1]], [1.0], prox_logp=torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    loss_fn = M2POLoss()
    loss_fn.prepare([full])  # prox says token 0 is far off-policy: it gets masked
    _, metrics = loss_fn(_inputs([[1.0, 0.0]], [[1, 1]], [1.0]))
    assert metrics["m2po_masked_frac"] == pytest.approx(0.5)


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=1, max_size=40),
    tau=st.floats(1e-4, 0.1),
)
def test_remaining_second_moment_is_within_tau_and_largest_go_first(values: list[float], tau: float) -> None:
    sq = torch.tensor(values, dtype=torch.float64) ** 2
    cut = second_moment_cut(sq, tau)
    keep = sq < cut
    kept, masked = sq[keep], sq[~keep]
    if kept.numel():
        assert kept.mean().item() <= tau * (1 + 1e-9) + 1e-15
    if kept.numel() and masked.numel():
        assert masked.min().item() >= kept.max().item()


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=1, max_size=40, unique=True),
    tau=st.floats(1e-4, 0.1),
)
def test_mask_is_minimal_for_distinct_values(values: list[float], tau: float) -> None:
    sq = torch.tensor(sorted({v * v for v in values}), dtype=torch.float64)
    cut = second_moment_cut(sq, tau)
    keep = sq < cut
    if bool((~keep).any()):
        # Unmasking the smallest masked token would break the bound.
        with_one_more = torch.cat([sq[keep], sq[~keep].min().reshape(1)])
        assert with_one_more.mean().item() > tau


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), tau=st.floats(1e-3, 0.05))
def test_loss_level_bound_holds_on_random_batches(seed: int, tau: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(3, 6, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.rand(3, 6, generator=gen) > 0.2).double()
    inputs = LossInputs(
        log_ratio.clone().requires_grad_(),
        torch.zeros(3, 6, dtype=torch.float64),
        mask,
        torch.ones(3, dtype=torch.float64),
    )
    loss, metrics = M2POLoss(M2POConfig(tau=tau))(inputs)
    assert metrics["m2po_m2_after"] <= tau * (1 + 1e-9)
    assert metrics["m2po_m2_after"] <= metrics["m2po_m2_before"] + 1e-15
    loss.backward()
    masked = (mask > 0) & (inputs.logp.grad == 0)
    assert masked.sum().item() == pytest.approx(metrics["m2po_masked_frac"] * mask.sum().item())

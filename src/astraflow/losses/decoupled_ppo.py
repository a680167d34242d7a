"""Decoupled PPO: clip against a proximal policy, reweight by the proximal-to-behaviour importance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from astraflow.errors import PluginError
from astraflow.losses.base import LossInputs, token_advantages
from astraflow.losses.family import (
    FamilyConfig,
    FamilyLoss,
    approx_kl,
    clipped_surrogate,
    masked_log_ratio,
    ratio_metrics,
)

if TYPE_CHECKING:
    import torch


class DecoupledPPOConfig(FamilyConfig):
    """Options of decoupled PPO."""

    clip_low: float = Field(0.2, ge=0)
    """Lower clip of pi / pi_prox: r >= 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip of pi / pi_prox: r <= 1 + clip_high."""
    weight_cap: float | None = Field(None, gt=0)
    """Cap on the behaviour weight pi_prox / pi_behaviour; None leaves it uncapped."""
    cap_mode: Literal["truncate", "mask"] = "truncate"
    """Above the cap: truncate sets the weight to the cap; mask drops the token from the gradient."""


def importance_weighted_surrogate(
    logp: torch.Tensor,
    anchor: torch.Tensor,
    inputs: LossInputs,
    clip_low: float,
    clip_high: float,
    cap: float | None,
    cap_mode: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token w * min(r A, clip(r) A), r = pi / anchor, w = anchor / behaviour (detached, capped); metrics."""
    import torch

    mask = inputs.mask
    on = mask > 0
    log_ratio = masked_log_ratio(logp, anchor, mask)
    ratio = torch.exp(log_ratio)
    objective, clipped = clipped_surrogate(ratio, token_advantages(inputs), clip_low, clip_high)
    with torch.no_grad():
        weight = torch.exp(masked_log_ratio(anchor.detach(), inputs.behaviour_logp, mask))
        over = on & (weight > cap) if cap is not None else torch.zeros_like(on)
        if cap is not None:
            replacement = cap if cap_mode == "truncate" else 0.0
            weight = torch.where(over, torch.full_like(weight, replacement), weight)
    metrics = ratio_metrics(ratio, mask, clipped)
    with torch.no_grad():
        n = on.sum().clamp(min=1)
        metrics["is_weight_mean"] = float((weight * mask).sum() / n)
        metrics["is_weight_max"] = float(weight[on].max()) if bool(on.any()) else 1.0
        metrics["is_weight_capped_frac"] = float(over.sum() / n)
        metrics["behaviour_kl"] = approx_kl(masked_log_ratio(logp, inputs.behaviour_logp, mask), mask)
    return weight * objective, metrics


class DecoupledPPOLoss(FamilyLoss):
    """loss = -token_mean(w * min(r A, clip(r) A)), r = pi / pi_prox, w = pi_prox / pi_behaviour."""

    Config = DecoupledPPOConfig
    needs_prox = True

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The behaviour-weighted surrogate clipped against the proximal policy."""
        cfg: DecoupledPPOConfig = self.config  # type: ignore[assignment]
        if inputs.prox_logp is None:
            raise PluginError(
                "decoupled_ppo got no proximal logprobs",
                hint="the trainer must compute prox_logp when loss.needs_prox is true",
            )
        objective, metrics = importance_weighted_surrogate(
            inputs.logp, inputs.prox_logp, inputs, cfg.clip_low, cfg.clip_high, cfg.weight_cap, cfg.cap_mode
        )
        metrics["approx_kl"] = approx_kl(
            masked_log_ratio(inputs.logp, inputs.prox_logp, inputs.mask), inputs.mask
        )
        return -self.reduce(objective, inputs), metrics

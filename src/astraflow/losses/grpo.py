"""GRPO: clipped importance-ratio objective on group-normalized advantages, token-level mean."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

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


class GRPOConfig(FamilyConfig):
    """Options of the GRPO objective."""

    clip_low: float = Field(0.2, ge=0)
    """Ratio lower clip: r >= 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Ratio upper clip: r <= 1 + clip_high (raise it for DAPO's clip-higher)."""


class GRPOLoss(FamilyLoss):
    """loss = -token_mean(min(r * A, clip(r, 1 - lo, 1 + hi) * A)), r = exp(logp - behaviour_logp)."""

    Config = GRPOConfig

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped surrogate, aggregated by `reduce`."""
        import torch

        cfg: GRPOConfig = self.config  # type: ignore[assignment]
        mask = inputs.mask
        log_ratio = masked_log_ratio(inputs.logp, inputs.behaviour_logp, mask)
        ratio = torch.exp(log_ratio)
        objective, clipped = clipped_surrogate(ratio, token_advantages(inputs), cfg.clip_low, cfg.clip_high)
        loss = -self.reduce(objective, inputs)
        metrics = ratio_metrics(ratio, mask, clipped)
        metrics["approx_kl"] = approx_kl(log_ratio, mask)
        return loss, metrics

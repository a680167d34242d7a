"""GRPO: clipped importance-ratio objective on group-normalized advantages, token-level mean."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from astraflow.losses.base import Loss, LossConfig, LossInputs, token_mean


class GRPOConfig(LossConfig):
    """Options of the GRPO objective."""

    clip_low: float = Field(0.2, ge=0)
    """Ratio lower clip: r >= 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Ratio upper clip: r <= 1 + clip_high (raise it for DAPO's clip-higher)."""


class GRPOLoss(Loss):
    """loss = -token_mean(min(r * A, clip(r, 1 - lo, 1 + hi) * A)), r = exp(logp - behaviour_logp)."""

    Config = GRPOConfig

    def __call__(self, inputs: LossInputs) -> tuple[Any, dict[str, Any]]:
        import torch

        cfg: GRPOConfig = self.config  # type: ignore[assignment]
        mask = inputs.mask
        log_ratio = (inputs.logp - inputs.behaviour_logp) * mask
        ratio = torch.exp(log_ratio)
        adv = inputs.advantages.unsqueeze(-1)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
        objective = torch.minimum(unclipped, clipped)
        loss = -token_mean(objective, mask, inputs.total_tokens)
        with torch.no_grad():
            n = mask.sum().clamp(min=1.0)
            was_clipped = ((clipped < unclipped) & (mask > 0)).float()
            metrics = {
                "clip_frac": float(was_clipped.sum() / n),
                "ratio_mean": float((ratio * mask).sum() / n),
                "ratio_max": float(torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()) if mask.any() else 1.0,
                "approx_kl": float(((ratio - 1) - log_ratio).mul(mask).sum() / n),
            }
        return loss, metrics

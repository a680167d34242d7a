"""GSPO: one importance ratio per sequence (geometric mean of its token ratios), clipped per sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from astraflow.errors import PluginError
from astraflow.losses.base import LossInputs
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


class GSPOConfig(FamilyConfig):
    """Options of the GSPO objective; its clip ranges are tiny because a sequence ratio moves little."""

    clip_low: float = Field(3e-4, ge=0)
    """Sequence-ratio lower clip: s >= 1 - clip_low."""
    clip_high: float = Field(4e-4, ge=0)
    """Sequence-ratio upper clip: s <= 1 + clip_high."""


class GSPOLoss(FamilyLoss):
    """s_i = exp(mean_t log r_it); loss = -sum_i min(s_i A_i, clip(s_i) A_i) / sequences of the batch."""

    Config = GSPOConfig

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The sequence-level clipped surrogate, averaged over the batch's sequences."""
        import torch

        cfg: GSPOConfig = self.config  # type: ignore[assignment]
        if inputs.advantages.dim() != 1:
            raise PluginError(
                "gspo is a sequence-level objective and got per-token advantages",
                hint='pair advantage = "gae" with a token-level loss (grpo, dapo, decoupled_ppo, tis, m2po)',
            )
        mask = inputs.mask
        log_ratio = masked_log_ratio(inputs.logp, inputs.behaviour_logp, mask)
        lengths = mask.sum(dim=-1)
        has_tokens = (lengths > 0).to(mask.dtype)
        seq_log_ratio = log_ratio.sum(dim=-1) / lengths.clamp(min=1.0)
        seq_ratio = torch.exp(seq_log_ratio)
        objective, clipped = clipped_surrogate(seq_ratio, inputs.advantages, cfg.clip_low, cfg.clip_high)
        if inputs.total_sequences is not None:
            sequences = max(float(inputs.total_sequences), 1.0)
            loss = -(objective * has_tokens).sum() / sequences
        else:
            loss = -(objective * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
        metrics = ratio_metrics(seq_ratio, has_tokens, clipped)
        metrics["approx_kl"] = approx_kl(log_ratio, mask)
        return loss, metrics

"""DAPO's objective: GRPO with decoupled clip-higher (0.2 / 0.28) and token-level aggregation."""

from __future__ import annotations

from pydantic import Field

from astraflow.losses.grpo import GRPOConfig, GRPOLoss


class DAPOConfig(GRPOConfig):
    """Options of the DAPO objective; dynamic sampling and overlong shaping are data stages, not this."""

    clip_low: float = Field(0.2, ge=0)
    """Ratio lower clip: r >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Ratio upper clip, wider than the lower one so low-probability tokens can still rise (clip-higher)."""


class DAPOLoss(GRPOLoss):
    """loss = -sum_tokens min(r A, clip(r, 1 - 0.2, 1 + 0.28) A) / trained tokens of the batch."""

    Config = DAPOConfig

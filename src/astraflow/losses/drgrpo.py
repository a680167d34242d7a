"""Dr.GRPO: GRPO without length normalisation; the token sum is divided by a constant."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from astraflow.losses.base import LossInputs
from astraflow.losses.grpo import GRPOConfig, GRPOLoss

if TYPE_CHECKING:
    import torch


class DrGRPOConfig(GRPOConfig):
    """Options of Dr.GRPO (pair it with policy.advantage = "drgrpo", the std-free advantage)."""

    max_tokens: int | None = Field(None, ge=1)
    """Per-sequence token budget in the constant (set it to sampling.max_new_tokens); None = padded width T."""


class DrGRPOLoss(GRPOLoss):
    """loss = -sum_{i,t} min(r A, clip(r) A) / (max_tokens * sequences), so long answers are not diluted."""

    Config = DrGRPOConfig

    def reduce(self, x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """Masked token sum divided by max_tokens * sequences of the whole batch."""
        cfg: DrGRPOConfig = self.config  # type: ignore[assignment]
        per_seq = cfg.max_tokens if cfg.max_tokens is not None else int(inputs.mask.shape[-1])
        sequences = inputs.total_sequences if inputs.total_sequences is not None else inputs.mask.shape[0]
        return (x * inputs.mask).sum() / max(float(per_seq) * float(sequences), 1.0)

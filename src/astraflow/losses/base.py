"""The Loss contract: a policy-gradient objective over a padded batch of sequences.

Imports torch only under TYPE_CHECKING so that listing and validating recipes stays light.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch


class LossConfig(BaseModel):
    """Base of every objective's options."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass
class LossInputs:
    """Tensors of one (mini)batch, all [B, T] aligned on predicted tokens except advantages ([B] or [B, T])."""

    logp: torch.Tensor
    """Logprobs of the taken tokens under the current parameters (requires grad)."""
    behaviour_logp: torch.Tensor
    """Logprobs returned by the rollout engine."""
    mask: torch.Tensor
    """1.0 where the token is trained on."""
    advantages: torch.Tensor
    """One scalar per sequence [B], broadcast over its tokens; or one per token [B, T] (advantage = "gae")."""
    ref_logp: torch.Tensor | None = None
    """Reference-model logprobs (for a KL term), if the objective asks for them."""
    prox_logp: torch.Tensor | None = None
    """Proximal-policy logprobs recomputed before the step (decoupled PPO), if asked for."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of the current policy, for metrics."""
    total_tokens: float | None = None
    """Trained tokens in the whole batch, so minibatch losses add up to a batch token-mean."""
    total_sequences: float | None = None
    """Sequences in the whole batch, for sequence-level or constant-normalised objectives (GSPO, Dr.GRPO)."""


class Loss(ABC):
    """An objective; `needs_ref` / `needs_prox` tell the trainer which extra logprobs to compute."""

    Config: type[LossConfig] = LossConfig
    needs_ref: bool = False
    needs_prox: bool = False

    def __init__(self, config: LossConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    def prepare(self, batch: list[LossInputs]) -> None:
        """See every (micro)batch of a step once, before its first update (logp may be detached); no-op here.

        A trainer calls this when it splits a batch into several loss calls, so that an objective defined
        over the whole batch (M2PO's token mask) can fix its batch-level quantities first.
        """
        return None

    @abstractmethod
    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, Any]]:
        """Return (scalar loss to minimise, metrics as floats)."""


def token_mean(x: torch.Tensor, mask: torch.Tensor, total_tokens: float | None = None) -> torch.Tensor:
    """Token-level mean of x over mask (over the whole batch when total_tokens is given)."""
    # An all-empty batch must give a finite zero, not 0 / 0.
    denom = max(float(total_tokens), 1.0) if total_tokens is not None else mask.sum().clamp(min=1.0)
    return (x * mask).sum() / denom


def token_advantages(inputs: LossInputs) -> torch.Tensor:
    """Advantages shaped to multiply per-token terms: [B, 1] from per-sequence ones, [B, T] as given."""
    adv = inputs.advantages
    return adv.unsqueeze(-1) if adv.dim() == 1 else adv

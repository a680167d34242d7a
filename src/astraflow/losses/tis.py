"""TIS: truncated importance sampling of the engine/trainer mismatch on top of the clipped surrogate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from astraflow.errors import PluginError
from astraflow.losses.base import LossConfig, LossInputs
from astraflow.losses.decoupled_ppo import importance_weighted_surrogate
from astraflow.losses.family import FamilyConfig, FamilyLoss, approx_kl, masked_log_ratio

if TYPE_CHECKING:
    import torch


class TISConfig(FamilyConfig):
    """Options of TIS."""

    clip_low: float = Field(0.2, ge=0)
    """Lower clip of pi / pi_old: r >= 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip of pi / pi_old: r <= 1 + clip_high."""
    cap: float = Field(2.0, gt=0)
    """Truncation C of the weight min(pi_old / pi_behaviour, C)."""
    use_prox: bool = True
    """Take pi_old from the trainer's recomputed logprobs; false uses detached logp (one update per batch)."""


class TISLoss(FamilyLoss):
    """loss = -token_mean(min(pi_old / pi_behaviour, C) * min(r A, clip(r) A)), r = pi / pi_old."""

    Config = TISConfig

    def __init__(self, config: LossConfig | None = None) -> None:
        super().__init__(config)
        cfg: TISConfig = self.config  # type: ignore[assignment]
        self.needs_prox = cfg.use_prox

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped surrogate against pi_old, times the truncated engine/trainer weight."""
        cfg: TISConfig = self.config  # type: ignore[assignment]
        if cfg.use_prox:
            if inputs.prox_logp is None:
                raise PluginError(
                    "tis got no proximal logprobs",
                    hint="the trainer must compute prox_logp when loss.needs_prox is true, or set use_prox = false",
                )
            old = inputs.prox_logp
        else:
            # The trainer's own logprobs before this update: equal to pi_old on the first update of a batch.
            old = inputs.logp.detach()
        objective, metrics = importance_weighted_surrogate(
            inputs.logp, old, inputs, cfg.clip_low, cfg.clip_high, cfg.cap, "truncate"
        )
        metrics["approx_kl"] = approx_kl(masked_log_ratio(inputs.logp, old, inputs.mask), inputs.mask)
        return -self.reduce(objective, inputs), metrics

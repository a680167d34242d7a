"""What every built-in GRPO-family objective shares: the KL option, ratio metrics, the clipped surrogate."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from pydantic import Field

from astraflow.errors import PluginError
from astraflow.losses.base import Loss, LossConfig, LossInputs, token_mean
from astraflow.losses.kl import k3

if TYPE_CHECKING:
    import torch


class FamilyConfig(LossConfig):
    """Options shared by every built-in objective."""

    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty against the reference model (0.001 in published recipes); 0 turns it off."""


class FamilyLoss(Loss):
    """Base of the built-in objectives: adds the optional KL term and the entropy metric to `policy_loss`."""

    Config = FamilyConfig

    def __init__(self, config: LossConfig | None = None) -> None:
        super().__init__(config)
        cfg: FamilyConfig = self.config  # type: ignore[assignment]
        # The trainer reads this on the instance: a reference model costs memory, so only when used.
        self.needs_ref = cfg.kl_coef > 0

    @abstractmethod
    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (policy-gradient loss to minimise, its metrics)."""

    def reduce(self, x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """Aggregate a per-token quantity into the loss's scale (token-level mean over the batch)."""
        return token_mean(x, inputs.mask, inputs.total_tokens)

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, Any]]:
        """Policy loss plus kl_coef * KL, with metrics."""
        import torch

        check_shapes(inputs)
        loss, metrics = self.policy_loss(inputs)
        cfg: FamilyConfig = self.config  # type: ignore[assignment]
        mask = inputs.mask
        n = mask.sum().clamp(min=1.0)
        if cfg.kl_coef > 0:
            if inputs.ref_logp is None:
                raise PluginError(
                    f"{type(self).__name__} has kl_coef > 0 but got no reference logprobs",
                    hint="the trainer must compute ref_logp when loss.needs_ref is true",
                )
            kl = k3(inputs.logp, inputs.ref_logp, mask)
            loss = loss + cfg.kl_coef * self.reduce(kl, inputs)
            with torch.no_grad():
                metrics["kl"] = float((kl * mask).sum() / n)
        if inputs.entropy is not None:
            with torch.no_grad():
                metrics["entropy"] = float((inputs.entropy.detach() * mask).sum() / n)
        return loss, metrics


def check_shapes(inputs: LossInputs) -> None:
    """Fail clearly when a trainer hands over misaligned tensors."""
    shape = tuple(inputs.logp.shape)
    named = {"behaviour_logp": inputs.behaviour_logp, "mask": inputs.mask}
    for name in ("ref_logp", "prox_logp", "entropy"):
        value = getattr(inputs, name)
        if value is not None:
            named[name] = value
    for name, value in named.items():
        if tuple(value.shape) != shape:
            raise PluginError(
                f"loss input {name} has shape {tuple(value.shape)}, logp has {shape}",
                hint="every per-token input is [B, T] aligned on predicted tokens",
            )
    if inputs.logp.dim() != 2 or tuple(inputs.advantages.shape) not in (shape[:1], shape):
        raise PluginError(
            f"advantages have shape {tuple(inputs.advantages.shape)}, expected ({shape[0]},) or {shape}"
            f" for logp {shape}",
            hint="advantages carry one scalar per sequence, or one per token (gae)",
        )


def masked_log_ratio(logp: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logp - anchor on trained tokens, 0 elsewhere (so padding never makes inf or NaN)."""
    import torch

    return torch.where(mask > 0, logp - anchor.detach(), torch.zeros_like(logp))


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's min(r * A, clip(r, 1 - lo, 1 + hi) * A) and where the clipped branch is active (no gradient)."""
    import torch

    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    return torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """clip_frac and ratio mean/min/max over the trained entries (1.0 for an empty mask)."""
    import torch

    with torch.no_grad():
        on = mask > 0
        n = on.sum().clamp(min=1)
        if not bool(on.any()):
            return {"clip_frac": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
        r = ratio.detach()[on]
        return {
            "clip_frac": float((clipped & on).sum() / n),
            "ratio_mean": float(r.mean()),
            "ratio_min": float(r.min()),
            "ratio_max": float(r.max()),
        }


def approx_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(behaviour || current) over trained tokens: how far the policy drifted."""
    import torch

    with torch.no_grad():
        lr = log_ratio.detach()
        return float(((torch.exp(lr) - 1.0 - lr) * mask).sum() / mask.sum().clamp(min=1.0))

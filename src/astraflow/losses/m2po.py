"""M2PO: a second-moment trust region; mask the most off-policy tokens until mean (log r)^2 <= tau."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from astraflow.losses.base import LossInputs, token_advantages
from astraflow.losses.family import FamilyConfig, FamilyLoss, approx_kl, masked_log_ratio, ratio_metrics

if TYPE_CHECKING:
    import torch


class M2POConfig(FamilyConfig):
    """Options of M2PO."""

    tau: float = Field(0.01, gt=0)
    """Bound on the mean (log r)^2 of the kept tokens: 0.01 for math/code, 0.004 for agent/search tasks."""
    scope: Literal["batch", "minibatch"] = "batch"
    """batch: use the cut fixed by prepare() over the whole batch when the trainer calls it; minibatch: each call."""


def second_moment_cut(sq: torch.Tensor, tau: float) -> float:
    """Smallest squared log ratio to mask so the mean of the rest is <= tau (inf when none needs masking).

    sq holds the (log r)^2 of the trained tokens (1-D). Removing the largest values first is optimal:
    it reaches the bound with the fewest tokens masked.
    """
    import torch

    n = int(sq.numel())
    if n == 0:
        return math.inf
    values = torch.sort(sq.detach().double().flatten(), descending=True).values
    total = values.sum()
    # remaining_mean[k] = mean after masking the k largest, k = 0..n; float64 keeps the suffix sums honest.
    removed = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
    count = torch.arange(n, -1, -1, dtype=values.dtype)
    remaining_mean = (total - removed).clamp(min=0.0) / count.clamp(min=1.0)
    remaining_mean[-1] = 0.0
    k = int(torch.nonzero(remaining_mean <= tau)[0])
    return math.inf if k == 0 else float(values[k - 1])


class M2POLoss(FamilyLoss):
    """loss = -token_mean(M * r * A), M = 0 on the largest-(log r)^2 tokens until the rest's mean <= tau."""

    Config = M2POConfig

    def __init__(self, config: M2POConfig | None = None) -> None:
        super().__init__(config)
        self._batch_cut: float | None = None

    def prepare(self, batch: list[LossInputs]) -> None:
        """Fix the cut over all the step's (micro)batches: prox_logp when given, else logp, vs behaviour."""
        import torch

        cfg: M2POConfig = self.config  # type: ignore[assignment]
        if cfg.scope != "batch":
            return
        squares = []
        for inputs in batch:
            current = inputs.prox_logp if inputs.prox_logp is not None else inputs.logp
            log_ratio = masked_log_ratio(current.detach(), inputs.behaviour_logp, inputs.mask)
            squares.append((log_ratio[inputs.mask > 0] ** 2).flatten())
        self._batch_cut = second_moment_cut(torch.cat(squares) if squares else torch.zeros(0), cfg.tau)

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """Unclipped r * A on the kept tokens, token-mean over all trained tokens."""
        import torch

        cfg: M2POConfig = self.config  # type: ignore[assignment]
        mask = inputs.mask
        log_ratio = masked_log_ratio(inputs.logp, inputs.behaviour_logp, mask)
        ratio = torch.exp(log_ratio)
        sq = log_ratio.detach() ** 2
        on = mask > 0
        if cfg.scope == "batch" and self._batch_cut is not None:
            cut = self._batch_cut
        else:
            cut = second_moment_cut(sq[on], cfg.tau)
        # Ties at the cut are masked too: they are the largest kept values, so dropping them keeps the bound.
        keep = (on & (sq < cut)).to(mask.dtype)
        objective = keep * ratio * token_advantages(inputs)
        loss = -self.reduce(objective, inputs)
        metrics = ratio_metrics(ratio, mask, on & (keep == 0))
        with torch.no_grad():
            n = on.sum().clamp(min=1)
            kept = keep.sum()
            metrics["m2po_masked_frac"] = metrics["clip_frac"]
            metrics["m2po_m2_before"] = float((sq * mask).sum() / n)
            metrics["m2po_m2_after"] = float((sq * keep).sum() / kept.clamp(min=1.0))
        metrics["approx_kl"] = approx_kl(log_ratio, mask)
        return loss, metrics

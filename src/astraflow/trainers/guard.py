"""The trainer's guard against learning from garbage: skipped steps counted, non-finite weights held back.

A trainer skips an update whose loss or gradient norm is not finite (trainers/torch_trainer.py); the
trainer role asks `SkipGuard` after every step, which reports the skip (metrics, a console line) and
stops the trainer once `policy.max_nonfinite_steps` steps in a row were skipped. Weights are checked
before each publish (`nonfinite_weights`), so no worker ever pulls a NaN.
"""

from __future__ import annotations

import math
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError

_log = log.get("trainer.guard")


class NonFiniteError(AstraflowError):
    """The trainer stops (exit 1): steps in a row did not learn, or its weights are not finite."""


def step_problem(metrics: dict[str, float]) -> str:
    """Why a step did not learn ('' when it did): it skipped updates, or reports a non-finite loss or
    gradient norm (a trainer plugin that does not skip is counted too)."""
    bad = [
        f"{k} {metrics[k]!r}" for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])
    ]
    skipped = metrics.get("skipped_updates", 0.0)
    if skipped:
        bad.append(f"{skipped:g} updates skipped")
    return ", ".join(bad)


class SkipGuard:
    """Counts steps in a row that did not learn; `after_step` reports one and raises at the limit."""

    def __init__(self, policy: str, limit: int) -> None:
        self.policy = policy
        self.limit = limit
        self.in_a_row = 0
        self.total = 0

    def after_step(self, step: int, metrics: dict[str, float]) -> str:
        """Record step `step`'s outcome in `metrics` (trainer_skipped_step, trainer_skipped_in_a_row);
        returns why it was skipped ('' when it learned); raises AstraflowError at the limit."""
        why = step_problem(metrics)
        if not why:
            self.in_a_row = 0
        else:
            self.in_a_row += 1
            self.total += 1
            _log.warning(
                "policy %s step %d skipped: %s (non-finite; %d in a row, the trainer stops at %d)",
                self.policy,
                step,
                why,
                self.in_a_row,
                self.limit,
            )
        metrics["trainer_skipped_step"] = 1.0 if why else 0.0
        metrics["trainer_skipped_in_a_row"] = float(self.in_a_row)
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"policy {self.policy}: {self.in_a_row} steps in a row (the last: {step}) had a non-finite "
                f"loss or gradient norm ({why}); stopping without learning from them",
                hint="look for results with extreme values (the controller's events and failures) or lower "
                "optimizer.lr; policy.max_nonfinite_steps sets how many in a row end the trainer",
            )
        return why


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics whose value is finite (a skipped step's NaN loss stays out of every sink)."""
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def nonfinite_weights(weights: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an inf (one host sync for all of them).

    A tensor's float32 sum is not finite if any element is not (one read, no temporary); only a tensor
    whose sum is not finite is then checked element by element, so huge finite weights whose sum
    overflows are not taken for NaN."""
    import torch

    names = [k for k, t in weights.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not names:
        return []
    sums = [weights[k].sum(dtype=torch.float32) for k in names]
    ok = torch.isfinite(torch.stack([s.to(sums[0].device) for s in sums])).tolist()
    suspects = [k for k, good in zip(names, ok, strict=True) if not good]
    return [k for k in suspects if not bool(torch.isfinite(weights[k]).all())]

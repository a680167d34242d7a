"""Group statistics and advantages, in plain Python and numpy (the controller imports no torch).

Rewards are scaled by the group's largest |reward| before any sum or square, so no group of finite
rewards overflows (16 rewards of 1.7e307 have a mean; their plain sum is inf). What can still be
non-finite (drgrpo's r - mean of two rewards near the float limit) is refused at ingest
(`nonfinite_advantage`), never stored.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from astraflow.dataflow.limits import RefusedResult

EPS = 1e-5


def group_advantages(rewards: list[float], kind: str = "grpo") -> list[float]:
    """Advantages of one group (same prompt, same policy).

    grpo: (r - mean) / (std + 1e-5) with the unbiased std (a singleton group uses std = 1);
    drgrpo: r - mean (no std division). A group of equal rewards gets 0 everywhere.
    """
    if kind not in ("grpo", "drgrpo"):
        raise ValueError(f"unknown advantage kind {kind!r}")
    n = len(rewards)
    if n == 0:
        return []
    if min(rewards) == max(rewards):
        return [0.0] * n  # also what the formula gives; exact, whatever the scale
    scale = max(map(abs, rewards))
    if not math.isfinite(scale):
        return [math.nan] * n  # refused at ingest (nonfinite_advantage)
    # (r - mean) / (std + eps) = (r' - mean') / (std' + eps / scale) with r' = r / scale in [-1, 1]
    scaled = [r / scale for r in rewards]
    mean = math.fsum(scaled) / n
    centered = [x - mean for x in scaled]
    if kind == "drgrpo":
        return [c * scale for c in centered]
    # n >= 2 here: a singleton group has equal rewards
    denom = math.sqrt(math.fsum(map(operator.mul, centered, centered)) / (n - 1)) + EPS / scale
    return [c / denom for c in centered] if denom > 0 else [0.0] * n


def groups_advantages(
    rewards: np.ndarray[Any, Any], starts: list[int], kind: str = "grpo"
) -> list[list[float]]:
    """`group_advantages` of every group rewards[starts[k]:starts[k + 1]] (each of one or more
    finite rewards), the elementwise steps as numpy passes over all of them at once.

    The same IEEE operations on the same operands (a division, a subtraction, a product are correctly
    rounded in numpy as in Python; the sums stay `math.fsum` per group), so the same values to the
    bit (tests/unit/test_groups_advantages.py). A group with a non-finite reward is not handled here:
    `group_advantages` reads its rewards' order (`min` and `max` with a NaN)."""
    if kind not in ("grpo", "drgrpo"):
        raise ValueError(f"unknown advantage kind {kind!r}")
    if len(starts) < 2:
        return []
    lo = np.asarray(starts[:-1], np.int64)
    sizes: np.ndarray[Any, Any] = np.diff(np.asarray(starts, np.int64))
    equal = (np.minimum.reduceat(rewards, lo) == np.maximum.reduceat(rewards, lo)).tolist()
    # a group of equal rewards gets 0 everywhere: its scale is never used (1.0 keeps the division quiet)
    scales = np.where(equal, 1.0, np.maximum.reduceat(np.abs(rewards), lo))
    per = np.repeat(scales, sizes)
    bounds = list(zip(starts, starts[1:], strict=False))
    with np.errstate(all="ignore"):  # drgrpo's c * scale may overflow to inf, as in Python
        scaled = rewards / per
        flat = scaled.tolist()
        means = [
            0.0 if eq else math.fsum(flat[a:b]) / (b - a) for eq, (a, b) in zip(equal, bounds, strict=True)
        ]
        centered = scaled - np.repeat(np.array(means, np.float64), sizes)
        if kind == "drgrpo":
            out = (centered * per).tolist()
            zero = equal
        else:
            sq = (centered * centered).tolist()
            denoms = [
                1.0 if eq else math.sqrt(math.fsum(sq[a:b]) / (b - a - 1)) + EPS / s
                for eq, (a, b), s in zip(equal, bounds, scales.tolist(), strict=True)
            ]
            zero = [eq or not d > 0 for eq, d in zip(equal, denoms, strict=True)]
            out = (
                centered
                / np.repeat(
                    np.array([1.0 if z else d for z, d in zip(zero, denoms, strict=True)], np.float64), sizes
                )
            ).tolist()
    return [[0.0] * (b - a) if z else out[a:b] for z, (a, b) in zip(zero, bounds, strict=True)]


def nonfinite_advantage(advantages: list[float]) -> str:
    """Why a group's advantages cannot be stored ('' when every one is finite)."""
    if all(map(math.isfinite, advantages)):
        return ""
    bad = [a for a in advantages if not math.isfinite(a)]
    return f"{len(bad)} advantages are not finite ({bad[0]!r})" if bad else ""


def checked_advantages(estimator: Any, policy: str, key: str, rewards: list[float]) -> list[float]:
    """The estimator's advantages of one group's rewards; RefusedResult when the estimator refuses them
    (non-finite rewards, overflow) or an advantage is not finite."""
    assert estimator is not None
    try:
        advantages: list[float] = estimator.group(rewards)
    except ValueError as exc:  # an estimator's refusal (non-finite rewards, overflow)
        raise RefusedResult(f"policy {policy!r} group {key!r}: {exc}") from None
    why = nonfinite_advantage(advantages)
    if why:
        raise RefusedResult(f"policy {policy!r} group {key!r}: {why} (rewards too far apart)")
    return advantages

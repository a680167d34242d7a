"""Group statistics and advantages, in plain Python (the controller imports no torch)."""

from __future__ import annotations

import math

EPS = 1e-5


def group_advantages(rewards: list[float], kind: str = "grpo") -> list[float]:
    """Advantages of one group (same prompt, same policy).

    grpo: (r - mean) / (std + 1e-5) with the unbiased std (a singleton group uses std = 1);
    drgrpo: r - mean (no std division).
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    if kind == "drgrpo":
        return [r - mean for r in rewards]
    if kind != "grpo":
        raise ValueError(f"unknown advantage kind {kind!r}")
    std = 1.0 if n == 1 else math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + EPS) for r in rewards]

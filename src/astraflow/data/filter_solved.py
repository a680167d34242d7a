"""filter_solved: stop submitting prompts the policy already solves reliably.

Each prompt keeps an exponentially weighted moving average of its groups' success,
`s <- decay * s + (1 - decay) * success`, and is skipped once `s >= skip_at`. A group's success is
its mean reward (`success = "mean"`) or the fraction of its rewards at or above `reward_threshold`
(`success = "threshold"`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from astraflow.data.base import Curator, StageConfig


class FilterSolvedConfig(StageConfig):
    """Options of the filter_solved curator."""

    decay: float = Field(0.9, ge=0, lt=1)
    """EWMA decay: the weight of the previous estimate."""
    skip_at: float = Field(0.95, gt=0, le=1)
    """A prompt whose success EWMA reaches this is no longer submitted."""
    success: Literal["mean", "threshold"] = "mean"
    """How a group's success is measured: its mean reward, or the fraction of rewards >= reward_threshold."""
    reward_threshold: float = 1.0
    """A reward at or above this is a success (with success = "threshold")."""
    initial: float = Field(0.0, ge=0, le=1)
    """Success estimate of a prompt before its first group; 0 means it must be solved repeatedly."""


class FilterSolvedCurator(Curator):
    """Skips prompts whose success EWMA reached `skip_at`."""

    Config = FilterSolvedConfig
    config: FilterSolvedConfig

    def __init__(self, config: FilterSolvedConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self.ewma: dict[str, float] = {}
        self.counts: dict[str, int] = {"submitted": 0, "skipped": 0}

    def group_success(self, rewards: list[float]) -> float:
        """Success of one group in [0, 1] for threshold mode, the mean reward for mean mode."""
        if not rewards:
            return 0.0
        if self.config.success == "threshold":
            return sum(r >= self.config.reward_threshold for r in rewards) / len(rewards)
        return sum(rewards) / len(rewards)

    def submit(self, key: str, sample: dict[str, Any]) -> bool:
        """False once the prompt's success estimate reached skip_at."""
        if self.ewma.get(key, self.config.initial) >= self.config.skip_at:
            self.counts["skipped"] += 1
            return False
        self.counts["submitted"] += 1
        return True

    def observe(self, key: str, rewards: list[float]) -> None:
        """Fold the group's success into the prompt's EWMA."""
        d = self.config.decay
        self.ewma[key] = d * self.ewma.get(key, self.config.initial) + (1 - d) * self.group_success(rewards)

    def state_dict(self) -> dict[str, Any]:
        """Per-prompt estimates and counters."""
        return {"ewma": dict(self.ewma), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.ewma = {k: float(v) for k, v in state["ewma"].items()}
        self.counts = {k: int(v) for k, v in state["counts"].items()}

    def metrics(self) -> dict[str, float]:
        """submitted, skipped (cumulative) and solved (prompts now at or above skip_at)."""
        solved = sum(v >= self.config.skip_at for v in self.ewma.values())
        return {**{k: float(v) for k, v in self.counts.items()}, "solved": float(solved)}

"""dynamic_sampling (DAPO): drop groups whose rewards are all equal, since every advantage is zero."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from astraflow.data.base import GroupFilter, GroupView, StageConfig, zero_variance


class DynamicSamplingConfig(StageConfig):
    """Options of the dynamic-sampling filter."""

    tol: float = Field(1e-9, ge=0)
    """Rewards closer than this count as equal."""


class DynamicSamplingFilter(GroupFilter):
    """Keeps only groups with some reward variance (a singleton group is always dropped)."""

    Config = DynamicSamplingConfig
    config: DynamicSamplingConfig

    def __init__(
        self, config: DynamicSamplingConfig | None = None, *, policy: str = "", seed: int = 0
    ) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self.counts: dict[str, int] = {"kept": 0, "filtered": 0}

    def keep(self, group: GroupView) -> bool:
        """False when every reward of the group is equal."""
        ok = not zero_variance(group.rewards, self.config.tol)
        self.counts["kept" if ok else "filtered"] += 1
        return ok

    def state_dict(self) -> dict[str, Any]:
        """The counters."""
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.counts = {k: int(v) for k, v in state["counts"].items()}

    def metrics(self) -> dict[str, float]:
        """kept, filtered (groups, cumulative)."""
        return {k: float(v) for k, v in self.counts.items()}

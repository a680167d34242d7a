"""dynamic_sampling (DAPO): drop groups whose rewards are all equal, since every advantage is zero."""

from __future__ import annotations

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
    counters = ("kept", "filtered")

    def keep(self, group: GroupView) -> bool:
        """False when every reward of the group is equal."""
        ok = not zero_variance(group.rewards, self.config.tol)
        self.counts["kept" if ok else "filtered"] += 1
        return ok

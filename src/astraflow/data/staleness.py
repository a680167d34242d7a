"""staleness: admit new work only while everything outstanding can still be consumed in bound.

Work is consumed in batches of `batch_size` groups, one batch per policy version. A group admitted
while `outstanding` groups are ahead of it (queued, leased, or finished and unconsumed) is consumed
about `outstanding // batch_size` versions later, and its tokens are no older than the version at
admission. So admitting only while `outstanding < (max_staleness + 1) * batch_size` keeps production
within the bound instead of generating samples that expire. It does not cover a worker still holding
weights older than the newest version; the buffer's check at batching still drops such samples.
"""

from __future__ import annotations

from pydantic import Field

from astraflow.data.base import AdmissionStage, StageConfig


class StalenessConfig(StageConfig):
    """Options of the staleness admission stage."""

    max_staleness: int | None = Field(None, ge=0)
    """Bound to admit for; None = the policy's max_staleness (a smaller value tightens it)."""


class StalenessAdmission(AdmissionStage):
    """Budgets outstanding groups to (max_staleness + 1) batches."""

    Config = StalenessConfig
    config: StalenessConfig
    counters = ("admitted", "held")

    def __init__(self, config: StalenessConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self._policy_bound: int | None = None

    @property
    def max_staleness(self) -> int:
        """The effective bound: the tighter of the stage's option and the policy's bound."""
        bounds = [b for b in (self.config.max_staleness, self._policy_bound) if b is not None]
        return min(bounds) if bounds else 1

    def bind(self, policy_max_staleness: int) -> None:
        """Record the policy's own bound (PolicyConfig.max_staleness)."""
        self._policy_bound = policy_max_staleness

    def budget(self, outstanding: int, batch_size: int) -> int:
        """Groups that may still be admitted: (max_staleness + 1) * batch_size - outstanding, at least 0."""
        return max(0, (self.max_staleness + 1) * max(1, batch_size) - outstanding)

    def admit(self, outstanding: int, batch_size: int) -> bool:
        """True while one more group fits the budget; counts admitted / held."""
        ok = self.budget(outstanding, batch_size) > 0
        self.counts["admitted" if ok else "held"] += 1
        return ok

    def metrics(self) -> dict[str, float]:
        """admitted, held (admission decisions, cumulative) and max_staleness."""
        return {**super().metrics(), "max_staleness": float(self.max_staleness)}

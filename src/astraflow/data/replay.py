"""replay: take a fixed fraction of each batch from the most recently consumed samples.

`replay_count(batch_size) = floor(ratio * batch_size)`, computed on the decimal value written in the
recipe so that 0.29 * 100 is 29, never more than the fraction. Replayed samples are an explicit
exception to single consumption and to the staleness bound (they were fresh when first trained on).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from pydantic import Field

from astraflow.data.base import BatchComposer, StageConfig


class ReplayConfig(StageConfig):
    """Options of the replay composer."""

    ratio: float = Field(0.3, ge=0, lt=1)
    """Fraction of each batch replayed from recently consumed samples (0.3-0.5 in published figures)."""


class ReplayComposer(BatchComposer):
    """Asks for floor(ratio * batch_size) replayed sequences per batch."""

    Config = ReplayConfig
    config: ReplayConfig

    def __init__(self, config: ReplayConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self._ratio = Decimal(repr(self.config.ratio))
        self.replayed = 0

    def replay_count(self, batch_size: int) -> int:
        """Sequences of this batch to take from the replay pool (pure; see on_batch for the counter)."""
        return math.floor(self._ratio * max(0, batch_size))

    def on_batch(self, replayed: int) -> None:
        """Count the sequences a recorded batch actually replayed (fewer early on, when the pool is small)."""
        self.replayed += replayed

    def state_dict(self) -> dict[str, Any]:
        """The counter."""
        return {"replayed": self.replayed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.replayed = int(state["replayed"])

    def metrics(self) -> dict[str, float]:
        """replayed: sequences actually replayed, cumulative."""
        return {"replayed": float(self.replayed)}

"""The Trainer contract: one optimizer step per batch, weights out, checkpoints in and out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from astraflow.protocol.messages import TrainSample


class Trainer(ABC):
    """Trains one policy. Built by the trainer role from the recipe's PolicyConfig."""

    Config: Any = None
    """Pydantic model of the trainer's options (recipe: policy.trainer_options)."""

    @property
    @abstractmethod
    def step_count(self) -> int:
        """Optimizer steps taken so far (0 before the first)."""

    @abstractmethod
    def step(self, batch: list[TrainSample]) -> dict[str, float]:
        """Take one optimizer step (minibatches inside) and return metrics; the samples' per-token data are
        packed arrays (TrainSample)."""

    @abstractmethod
    def export_weights(self) -> dict[str, Any]:
        """The current weights as a name -> tensor mapping (what engines load)."""

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, RNG states and step to directory `path`."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore everything save_checkpoint wrote."""

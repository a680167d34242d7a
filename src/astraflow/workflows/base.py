"""The Workflow contract: one coroutine turns a sample into an Episode, calling policies by role."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol

from pydantic import BaseModel

from astraflow.engines.base import Completion
from astraflow.protocol.messages import Episode, Sequence

__all__ = ["Episode", "Sequence", "PolicyClient", "Workflow"]


class PolicyClient(Protocol):
    """What a workflow sees of one policy: a tokenizer and a generate call."""

    policy: str
    tokenizer: Any
    """A transformers tokenizer of the policy's model."""

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        """Sample n completions of prompt_ids with the recipe's sampling settings (overridable)."""
        ...


class Workflow(ABC):
    """An agent workflow / environment with its reward. Subclasses set Config and roles."""

    Config: type[BaseModel]
    """Options model (recipe: workflow.options)."""
    roles: tuple[str, ...] = ("actor",)
    """Roles this workflow calls; the recipe maps each to a policy."""

    def __init__(self, config: BaseModel) -> None:
        self.config = config

    @abstractmethod
    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """Prompt samples when the recipe names no dataset file; runs in the controller (no torch)."""

    @abstractmethod
    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Play one episode of `sample`; the returned sequences carry rewards."""

"""What a trainer reads of the recipe: its own policy's section and what it reads of [run], [weights]
and [eval], picked by the controller for the trainer's Welcome (no other policy's section reaches it)
and validated where they arrive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, TypeAdapter

from astraflow.config.recipe import PolicyConfig, Recipe, WeightsConfig


@dataclass(frozen=True)
class TrainerSections:
    """The recipe's sections a trainer uses, and nothing else of it."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # Welcome.sections: nothing else is accepted

    policy: PolicyConfig
    """The policy it trains: model, trainer, optimizer, loss, checkpoints, threads."""
    budget: int
    """Steps it trains (`policy.steps`, else `run.steps`; 0 for a frozen policy)."""
    run_name: str
    """The run's name (its checkpoint directory's default place)."""
    seed: int
    """The run's seed: the trainer's initialisation and data order derive from it."""
    weights: WeightsConfig
    """How it publishes weights (`[weights]`)."""
    eval: bool
    """Whether a held-out eval may pull its last version (the run has `[eval]`): it then serves it
    until the controller says the run is done."""

    @classmethod
    def of(cls, recipe: Recipe, policy: str) -> TrainerSections:
        """The sections of a validated recipe for `policy`'s trainer (KeyError: no such policy)."""
        return cls(
            policy=recipe.get_policy(policy),
            budget=recipe.budget(policy),
            run_name=recipe.run.name,
            seed=recipe.run.seed,
            weights=recipe.weights,
            eval=recipe.eval is not None,
        )

    def to_wire(self) -> dict[str, Any]:
        """The sections as a Welcome carries them (plain JSON values)."""
        return dict(TypeAdapter(TrainerSections).dump_python(self, mode="json"))

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> TrainerSections:
        """The sections a Welcome carried, validated (RecipeError naming each bad field)."""
        from astraflow.config.load import validate_section

        return validate_section(cls, doc, "the sections from the controller", what="set of trainer sections")

"""What a rollout worker reads of the recipe: its sections, picked by the controller for the worker's
Welcome (nothing else of the recipe reaches a worker) and validated where they arrive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, TypeAdapter

from astraflow.config.recipe import PolicyConfig, Recipe, RolloutConfig, WeightsConfig, WorkflowConfig


@dataclass(frozen=True)
class RaaSSections:
    """The recipe's sections a RaaS uses, and nothing else of it."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # Welcome.sections: nothing else is accepted

    workflow: WorkflowConfig
    """The workflow it runs (`[workflow]`)."""
    roles: dict[str, str]
    """Workflow role -> policy name (config.load.role_map)."""
    policies: dict[str, PolicyConfig]
    """The policies its workflow's roles map to, by name: engines, models, sampling."""
    rollout: RolloutConfig
    """Task and drain timeouts, threads and slots (`[rollout]`)."""
    weights: WeightsConfig
    """How new weights reach it (`[weights]`)."""
    seed: int
    """The run's seed: engine streams and per-task sampling seeds derive from it."""

    @classmethod
    def of(cls, recipe: Recipe, roles: dict[str, str] | None = None) -> RaaSSections:
        """The sections of a validated recipe (`roles`: its role map, when already at hand)."""
        from astraflow.config.load import role_map

        roles = dict(roles) if roles is not None else role_map(recipe)
        return cls(
            workflow=recipe.workflow,
            roles=roles,
            policies={name: recipe.get_policy(name) for name in sorted(set(roles.values()))},
            rollout=recipe.rollout,
            weights=recipe.weights,
            seed=recipe.run.seed,
        )

    def to_wire(self) -> dict[str, Any]:
        """The sections as a Welcome carries them (plain JSON values)."""
        return dict(TypeAdapter(RaaSSections).dump_python(self, mode="json"))

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> RaaSSections:
        """The sections a Welcome carried, validated (RecipeError naming each bad field)."""
        from astraflow.config.load import validate_section

        return validate_section(cls, doc, "the sections from the controller", what="set of worker sections")

"""What a rollout worker reads of the recipe: its sections, picked by the controller for the worker's
Welcome (nothing else of the recipe reaches a worker) and validated where they arrive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from astraflow.config.recipe import PolicyConfig, Recipe, RolloutConfig, WeightsConfig, WorkflowConfig


class _Wire(BaseModel):
    """The sections as the Welcome carries them (`Welcome.sections` of a raas member)."""

    model_config = ConfigDict(extra="forbid")

    workflow: WorkflowConfig
    """`[workflow]`."""
    roles: dict[str, str]
    """Workflow role -> policy name."""
    policies: dict[str, PolicyConfig]
    """The `[[policy]]` sections of the policies the roles map to, by name."""
    rollout: RolloutConfig
    """`[rollout]`."""
    weights: WeightsConfig
    """`[weights]`."""
    seed: int
    """`run.seed`."""


@dataclass(frozen=True)
class RaaSSections:
    """The recipe's sections a RaaS uses, and nothing else of it."""

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
        return _Wire(
            workflow=self.workflow,
            roles=self.roles,
            policies=self.policies,
            rollout=self.rollout,
            weights=self.weights,
            seed=self.seed,
        ).model_dump(mode="json")

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> RaaSSections:
        """The sections a Welcome carried, validated (RecipeError naming each bad field)."""
        from astraflow.config.load import validate_section

        w = validate_section(_Wire, doc, "the sections from the controller", what="set of worker sections")
        return cls(
            workflow=w.workflow,
            roles=w.roles,
            policies=w.policies,
            rollout=w.rollout,
            weights=w.weights,
            seed=w.seed,
        )

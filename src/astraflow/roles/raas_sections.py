"""What a rollout worker reads of the recipe: its sections, picked once where the recipe arrives."""

from __future__ import annotations

from dataclasses import dataclass

from astraflow.config.recipe import PolicyConfig, Recipe, RolloutConfig, WeightsConfig, WorkflowConfig


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
    """Task and drain timeouts (`[rollout]`)."""
    weights: WeightsConfig
    """How new weights reach it (`[weights]`)."""
    seed: int
    """The run's seed: engine streams and per-task sampling seeds derive from it."""

    @classmethod
    def of(cls, recipe: Recipe) -> RaaSSections:
        """The sections of a validated recipe."""
        from astraflow.config.load import role_map

        roles = role_map(recipe)
        return cls(
            workflow=recipe.workflow,
            roles=roles,
            policies={name: recipe.get_policy(name) for name in sorted(set(roles.values()))},
            rollout=recipe.rollout,
            weights=recipe.weights,
            seed=recipe.run.seed,
        )

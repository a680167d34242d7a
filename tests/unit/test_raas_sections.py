"""A rollout worker gets the recipe's sections it uses: the workflow, the policies its roles map to,
rollout, weights and the run's seed."""

from __future__ import annotations

import dataclasses

import pytest

from astraflow.config.recipe import Recipe
from astraflow.roles.raas_sections import RaaSSections


def test_sections_hold_the_mapped_policies_and_the_worker_s_sections() -> None:
    recipe = Recipe.model_validate(
        {
            "run": {"seed": 17},
            "policy": [
                {"name": "proposer", "model": "m1"},
                {"name": "solver", "model": "m2"},
                {"name": "unused", "model": "m3"},
            ],
            "workflow": {"name": "collab", "roles": {"proposer": "proposer", "solver": "solver"}},
            "rollout": {"task_timeout_s": 42.0},
        }
    )
    s = RaaSSections.of(recipe)
    assert s.roles == {"proposer": "proposer", "solver": "solver"}
    assert sorted(s.policies) == ["proposer", "solver"]  # never a policy no role maps to
    assert s.policies["solver"].model == "m2"
    assert s.workflow.name == "collab" and s.rollout.task_timeout_s == 42.0 and s.seed == 17
    assert s.weights == recipe.weights
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]

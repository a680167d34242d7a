"""A rollout worker gets the recipe's sections it uses: the workflow, the policies its roles map to,
rollout, weights and the run's seed; a trainer its own policy, budget, run name and seed, weights and
whether there is an eval. Both travel in the Welcome as plain JSON and are validated where they land
(the live Welcome is tests/integration/test_member_sections.py)."""

from __future__ import annotations

import dataclasses

import pytest

from astraflow.config.recipe import Recipe
from astraflow.errors import RecipeError
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.roles.member_sections import sections_for
from astraflow.roles.raas_sections import RaaSSections
from astraflow.roles.trainer_sections import TrainerSections


def _recipe() -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"seed": 17},
            "policy": [
                {"name": "proposer", "model": "m1"},
                {"name": "solver", "model": "m2"},
                {"name": "unused", "model": "m3"},
            ],
            "workflow": {"name": "collab", "roles": {"proposer": "proposer", "solver": "solver"}},
            "rollout": {"task_timeout_s": 42.0},
            "eval": {"every_versions": 1},
        }
    )


def test_sections_hold_the_mapped_policies_and_the_worker_s_sections() -> None:
    recipe = _recipe()
    s = RaaSSections.of(recipe)
    assert s.roles == {"proposer": "proposer", "solver": "solver"}
    assert sorted(s.policies) == ["proposer", "solver"]  # never a policy no role maps to
    assert s.policies["solver"].model == "m2"
    assert s.workflow.name == "collab" and s.rollout.task_timeout_s == 42.0 and s.seed == 17
    assert s.weights == recipe.weights
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]


def _through_the_wire(doc: dict) -> dict:  # type: ignore[type-arg]
    welcome = decode(encode(m.Welcome(rid=1, run_name="r", sections=doc, heartbeat_interval_s=0.5)))
    assert isinstance(welcome, m.Welcome)
    return welcome.sections


def test_each_role_s_sections_survive_the_welcome_and_nothing_else_is_sent() -> None:
    recipe = _recipe()
    roles = {"proposer": "proposer", "solver": "solver"}
    raas = RaaSSections.from_wire(_through_the_wire(sections_for(recipe, "raas", ["proposer"], roles)))
    assert raas == RaaSSections.of(recipe)
    doc = sections_for(recipe, "trainer", ["solver"], roles)
    assert "unused" not in str(doc) and "m1" not in str(doc)  # no other policy's section
    trainer = TrainerSections.from_wire(_through_the_wire(doc))
    assert trainer == TrainerSections.of(recipe, "solver")
    assert trainer.policy.model == "m2" and trainer.budget == recipe.run.steps and trainer.eval is True
    assert sections_for(recipe, "observer", [], roles) == {}


def test_sections_that_do_not_validate_are_one_clear_error() -> None:
    doc = TrainerSections.of(_recipe(), "solver").to_wire()
    doc["policy"]["lr_typo"] = 1.0
    del doc["budget"]
    with pytest.raises(RecipeError) as err:
        TrainerSections.from_wire(doc)
    assert "policy.lr_typo" in err.value.message and "budget" in err.value.message
    with pytest.raises(RecipeError, match="rollout"):
        RaaSSections.from_wire({**RaaSSections.of(_recipe()).to_wire(), "rollout": {"slots": 0}})

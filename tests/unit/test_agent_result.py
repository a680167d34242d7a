"""What an agent may return (openai_agent): numbers, per-role rewards, episode info; clear errors."""

from __future__ import annotations

import math

import pytest

from astraflow.config.load import validate_plugins
from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.errors import AstraflowError, RecipeError
from astraflow.workflows.openai.agent import agent_result

ROLES = ("proposer", "solver")


def test_numbers_and_dicts() -> None:
    r = agent_result(0.5, ROLES)
    assert (r.reward, r.rewards, r.info) == (0.5, {}, {})
    r = agent_result(
        {"reward": 1, "rewards": {"solver": 0.25}, "info": {"acc": 0.5, "ok": True}, "n": 2}, ROLES
    )
    assert r.reward == 1.0 and r.rewards == {"solver": 0.25}
    assert r.info == {"acc": 0.5, "ok": 1.0, "n": 2.0}
    # per-role rewards alone (no default)
    assert agent_result({"rewards": {"proposer": 0, "solver": 1}}, ROLES).reward is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("text", "not a number"),
        (True, "not a number"),
        (math.nan, "not finite"),
        ({"info": {"a": 1}}, "without 'reward' or 'rewards'"),
        ({"reward": 1.0, "rewards": {"judge": 1.0}}, r"roles \['judge'\]"),
        ({"reward": 1.0, "rewards": {"solver": "high"}}, "reward of role 'solver'"),
        ({"reward": 1.0, "turns": 3}, "'turns' is taken"),
        ({"reward": 1.0, "info": {"a": 1}, "a": 2}, "'a' is taken"),
        ({"reward": 1.0, "trace": [1, 2]}, "'trace'"),
        ({"reward": 1.0, "tag": "x"}, "'tag' = 'x'"),
        ({"reward": 1.0, "info": [1]}, "'info' must be a dict"),
    ],
)
def test_refused_with_the_reason(value: object, match: str) -> None:
    with pytest.raises(AstraflowError, match=match):
        agent_result(value, ROLES)


def test_openai_agent_recipes_may_name_any_roles() -> None:
    rec = Recipe(
        workflow={
            "name": "openai_agent",
            "options": {"agent": "m:agent"},
            "roles": {"proposer": "a", "solver": "b"},
        },
        policy=[PolicyConfig(name="a", model="m"), PolicyConfig(name="b", model="m")],  # type: ignore[arg-type]
    )
    validate_plugins(rec, torch_plugins=False)
    # a fixed-role workflow still refuses unknown roles
    rec2 = Recipe(
        workflow={"name": "quickstart", "roles": {"proposer": "a"}},
        policy=[PolicyConfig(name="a", model="m")],  # type: ignore[arg-type]
    )
    with pytest.raises(RecipeError, match="does not have"):
        validate_plugins(rec2, torch_plugins=False)

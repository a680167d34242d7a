"""Which sampling settings a result may claim: the task's, or per-call overrides inside the recipe's
bounds; never a temperature the trainer cannot divide by."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from astraflow.config.recipe import Recipe, SamplingConfig
from astraflow.dataflow.sampling_rule import sampling_problem
from astraflow.dataflow.validate import ResultChecker
from astraflow.protocol.messages import MIN_TEMPERATURE, Episode, SamplingParams, Sequence


def test_the_tasks_settings_and_overrides_inside_the_bounds_are_allowed() -> None:
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    assert sampling_problem(SamplingParams(temperature=0.7, top_p=0.9), cfg, {}) == ""
    # default bounds: temperature in [0.01, 2.0], top_p may change, top_k may not
    assert sampling_problem(SamplingParams(temperature=1.5, top_p=0.9), cfg, {}) == ""
    assert sampling_problem(SamplingParams(temperature=0.7, top_p=0.5), cfg, {}) == ""
    assert "top_k 5 differs" in sampling_problem(SamplingParams(temperature=0.7, top_p=0.9, top_k=5), cfg, {})
    assert "[0.01, 2.0]" in sampling_problem(SamplingParams(temperature=2.5, top_p=0.9), cfg, {})
    # a recipe temperature above the bounds is still the task's own
    hot = SamplingConfig(temperature=3.0)
    assert sampling_problem(SamplingParams(temperature=3.0), hot, {}) == ""
    # an evaluation task's eval.sampling is what that task asked for, also outside the bounds
    tight = SamplingConfig(temperature=1.0, overrides={"temperature": (0.9, 1.1), "top_p": False})
    assert "top_p" in sampling_problem(SamplingParams(temperature=1.0, top_p=0.8), tight, {})
    eval_task = {"temperature": 0.5, "top_p": 0.8}
    assert sampling_problem(SamplingParams(temperature=0.5, top_p=0.8), tight, eval_task) == ""
    allow_k = SamplingConfig(overrides={"top_k": True})
    assert sampling_problem(SamplingParams(top_k=5), allow_k, {}) == ""


@pytest.mark.parametrize(
    ("claimed", "why"),
    [
        (SamplingParams(temperature=1e-300), "temperature 1e-300 is not a finite number >= 0.01"),
        (SamplingParams(temperature=0.0), "temperature 0.0"),
        (SamplingParams(temperature=-1.0), "temperature -1.0"),
        (SamplingParams(temperature=math.nan), "temperature nan"),
        (SamplingParams(temperature=math.inf), "temperature inf"),
        (SamplingParams(top_p=0.0), "top_p 0.0 is not in (0, 1]"),
        (SamplingParams(top_p=1.5), "top_p 1.5"),
        (SamplingParams(top_p=math.nan), "top_p nan"),
        (SamplingParams(top_k=-1), "top_k -1"),
        (SamplingParams(top_k=1 << 63), "is not an integer in [0, 2**31)"),
    ],
)
def test_settings_nobody_can_train_on_are_refused_whatever_the_bounds(
    claimed: SamplingParams, why: str
) -> None:
    wide = SamplingConfig(overrides={"temperature": (MIN_TEMPERATURE, 1e6), "top_p": True, "top_k": True})
    assert why in sampling_problem(claimed, wide, {})


def test_recipe_refuses_a_temperature_the_trainer_cannot_divide_by() -> None:
    with pytest.raises(ValidationError):
        SamplingConfig(temperature=1e-300)
    with pytest.raises(ValidationError):
        SamplingConfig(overrides={"temperature": (1e-300, 1.0)})
    with pytest.raises(ValidationError):
        SamplingConfig(overrides={"temperature": (1.5, 1.0)})
    with pytest.raises(ValidationError):
        SamplingConfig(overrides={"temperature": (0.5, math.inf)})


def test_the_result_checker_names_the_sequence_and_the_reason(tiny_model: Path) -> None:
    recipe = Recipe.model_validate(
        {
            "policy": [{"model": str(tiny_model), "group_size": 1, "sampling": {"temperature": 0.7}}],
            "workflow": {"name": "quickstart"},
        }
    )
    checker = ResultChecker(recipe)

    def result(sampling: SamplingParams) -> list[Episode]:
        seq = Sequence(
            policy="main",
            tokens=[1, 5, 6],
            loss_mask=[0, 1, 1],
            logprobs=[0.0, -0.1, -0.2],
            versions=[-1, 0, 0],
            sampling=sampling,
        )
        return [Episode(sequences=[seq])]

    def check(sampling: SamplingParams, task: dict[str, float | int] | None = None) -> str:
        return checker.check(
            result(sampling),
            expected={"main": 1},
            roles={"actor": "main"},
            latest={"main": 0},
            task_sampling=task,
        )

    assert check(SamplingParams(temperature=0.7)) == ""
    bad = check(SamplingParams(temperature=1e-300))
    assert bad.startswith(
        "episode 0 sequence 0: sampling settings not allowed by the task: temperature 1e-300"
    )
    assert "top_k 3 differs" in check(SamplingParams(temperature=0.7, top_k=3))
    assert check(SamplingParams(temperature=0.3), {"temperature": 0.3}) == ""  # eval.sampling of the task

"""The per-token rules of a result, run as whole-list operations: each rule still refuses what it
refused when it was a loop over tokens, and names the first offending value.

Real recipe (recipes/quickstart/recipe.toml), the real ResultChecker; sequences are built here."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config.load import load_recipe
from astraflow.data.turns import mask_runs
from astraflow.dataflow.buffer import min_version
from astraflow.dataflow.validate import ResultChecker
from astraflow.protocol.messages import Episode, SamplingParams, Sequence

RECIPE = Path(__file__).resolve().parents[2] / "recipes/quickstart/recipe.toml"


def _seq(loss_mask: list[int], versions: list[int], logprobs: list[float] | None = None) -> Sequence:
    n = len(loss_mask)
    return Sequence(
        policy="main",
        tokens=list(range(1, n + 1)),
        loss_mask=loss_mask,
        logprobs=logprobs if logprobs is not None else [0.0 if m == 0 else -0.5 for m in loss_mask],
        versions=versions,
        sampling=SamplingParams(),
    )


@pytest.fixture(scope="module")
def checker() -> ResultChecker:
    recipe = load_recipe(RECIPE, ["policy.model=unused"])
    return ResultChecker(recipe, vocab={"main": None})


def _why(checker: ResultChecker, seq: Sequence, newest: int = 3) -> str:
    roles = {"solver": "main"}
    return checker.check(
        [Episode(sequences=[seq])], expected={"main": 1}, roles=roles, latest={"main": newest}
    )


@pytest.mark.parametrize(
    ("mask", "versions", "logprobs", "want"),
    [
        ([0, 1, 1], [-1, 2, 3], None, ""),
        ([0, 0, 0], [-1, -1, -1], None, ""),
        ([0, 2, 1], [-1, 2, 3], None, "loss_mask holds values other than 0 and 1"),
        ([0, 1, 1], [-1, 2, 4], None, "version 4 does not exist (newest 3"),
        ([0, 1, 1], [-2, 2, 3], None, "version -2 does not exist"),
        ([0, 1, 1], [-1, -1, 3], None, "version -1 does not exist"),
        ([1, 1, 0], [0, 7, 9], None, "version 7 does not exist"),
        ([0, 1, 1], [-1, 2, 3], [0.0, -0.5, 0.1], "logprobs must be finite and <= 0"),
        ([0, 1, 1], [-1, 2, 3], [0.0, float("nan"), -0.1], "logprobs must be finite and <= 0"),
    ],
)
def test_each_token_rule_refuses_what_it_should(
    checker: ResultChecker, mask: list[int], versions: list[int], logprobs: list[float] | None, want: str
) -> None:
    why = _why(checker, _seq(mask, versions, logprobs))
    if want:
        assert want in why
    else:
        assert why == ""


def test_mask_runs_and_oldest_version_match_the_token_loop() -> None:
    assert mask_runs([0, 0, 1, 1, 0, 1]) == [(2, 2), (5, 1)]
    assert mask_runs([1, 1]) == [(0, 2)] and mask_runs([0]) == [] and mask_runs([]) == []
    # values a checked mask never holds still give the runs of non-zero entries
    assert mask_runs([0, 2, 300, 0, -1]) == [(1, 2), (4, 1)]
    assert min_version(_seq([0, 1, 1], [-1, 5, 4])) == 4
    assert min_version(_seq([0, 0], [-1, 2])) == 2  # nothing generated: the oldest version present
    assert min_version(_seq([0, 0], [-1, -1])) == -1
    assert min_version(_seq([1, 1], [-1, 6])) == 6  # an unversioned generated token is skipped

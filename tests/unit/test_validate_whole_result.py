"""A result's sequences are checked at once (ResultChecker._clean) before any walk one by one: for
every kind of fault planted in one sequence of a 16-sequence result, the whole-result pass lets the
fault through to the walk, and the answer is the one the walk alone gives (same sequence, same words).

Real recipe (recipes/quickstart/recipe.toml), the real ResultChecker; sequences are built here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from astraflow.config.load import load_recipe
from astraflow.dataflow.validate import ResultChecker
from astraflow.protocol.messages import Episode, SamplingParams, Sequence

RECIPE = Path(__file__).resolve().parents[2] / "recipes/quickstart/recipe.toml"
ROLES = {"solver": "main"}
N = 16


def _seq(k: int) -> Sequence:
    return Sequence(
        policy="main",
        tokens=[1, 2, 3, 4 + k % 5, 5],
        loss_mask=[0, 0, 0, 1, 1],
        logprobs=[0.0, 0.0, 0.0, -0.5, -0.25],
        versions=[-1, -1, -1, 2, 3],
        reward=float(k % 2),
        sampling=SamplingParams(),
    )


def _with(**fields: object) -> Callable[[Sequence], Sequence]:
    return lambda s: msgspec.structs.replace(s, **fields)


FAULTS: dict[str, Callable[[Sequence], Sequence]] = {
    "unknown policy": _with(policy="other"),
    "no tokens": _with(tokens=[], loss_mask=[], logprobs=[], versions=[]),
    "short mask": _with(loss_mask=[0, 0, 1, 1]),
    "short logprobs": _with(logprobs=[0.0, -0.5]),
    "short versions": _with(versions=[-1, 3]),
    "negative token": _with(tokens=[1, -2, 3, 4, 5]),
    "token past vocabulary": _with(tokens=[1, 2, 3, 4, 1_000_000]),
    "mask of 2": _with(loss_mask=[0, 0, 0, 2, 1]),
    "mask of -1": _with(loss_mask=[0, 0, 0, -1, 1]),
    "mask of 257": _with(loss_mask=[0, 0, 0, 257, 1]),
    "positive logprob": _with(logprobs=[0.0, 0.0, 0.0, 0.5, -0.25]),
    "nan logprob": _with(logprobs=[0.0, 0.0, 0.0, float("nan"), -0.25]),
    "leading nan logprob": _with(logprobs=[float("nan"), 0.0, 0.0, -0.5, -0.25]),
    "inf logprob": _with(logprobs=[0.0, 0.0, 0.0, float("inf"), -0.25]),
    "-inf logprob": _with(logprobs=[0.0, 0.0, 0.0, float("-inf"), -0.25]),
    "logprob below the floor": _with(logprobs=[0.0, 0.0, 0.0, -5000.0, -0.25]),
    "future version": _with(versions=[-1, -1, -1, 2, 9]),
    "version -2": _with(versions=[-2, -1, -1, 2, 3]),
    "unversioned generated token": _with(versions=[-1, -1, -1, -1, 3]),
    "nan reward": _with(reward=float("nan")),
    "huge reward": _with(reward=1e300),
    "too long": _with(
        tokens=[1] * 100_000, loss_mask=[0] * 100_000, logprobs=[0.0] * 100_000, versions=[-1] * 100_000
    ),
    "cold temperature": _with(sampling=SamplingParams(temperature=1e-300)),
    "other top_k": _with(sampling=SamplingParams(top_k=7)),
    "turns off the mask": _with(turns=[(0, 2, False)]),
}


@pytest.fixture(scope="module")
def checker() -> ResultChecker:
    recipe = load_recipe(RECIPE, ["policy.model=unused"])
    return ResultChecker(recipe, vocab={"main": 1000})


def _check(checker: ResultChecker, episodes: list[Episode]) -> str:
    return checker.check(episodes, expected={"main": N}, roles=ROLES, latest={"main": 3})


def test_a_clean_result_passes_the_whole_result_pass(checker: ResultChecker) -> None:
    seqs = [_seq(k) for k in range(N)]
    assert checker._clean(seqs, {"main"}, {"main": 3}, {})
    assert _check(checker, [Episode(sequences=[s]) for s in seqs]) == ""


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("where", [0, 9, N - 1])
def test_a_fault_anywhere_gets_the_answer_of_the_walk(
    checker: ResultChecker, monkeypatch: pytest.MonkeyPatch, fault: str, where: int
) -> None:
    seqs = [_seq(k) for k in range(N)]
    seqs[where] = FAULTS[fault](seqs[where])
    episodes = [Episode(sequences=[s]) for s in seqs]
    assert not checker._clean(seqs, {"main"}, {"main": 3}, {})
    got = _check(checker, episodes)
    assert got.startswith(f"episode {where} sequence 0: "), got
    with monkeypatch.context() as mp:  # the walk alone
        mp.setattr(ResultChecker, "_clean", lambda *_a, **_k: False)
        assert _check(checker, episodes) == got

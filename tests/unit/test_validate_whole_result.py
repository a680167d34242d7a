"""A result's sequences are checked at once (ResultChecker._clean, over the packed arrays) before any
walk one by one: for every kind of fault planted in one sequence of a 16-sequence result, the
whole-result pass lets the fault through to the walk, and the answer is the one the walk alone gives
(same sequence, same words). Faults only the packed form can carry (a size that is not a whole number
of items, arrays of different lengths) are planted in the bytes of a decoded TaskResult.

Real recipe (recipes/quickstart/recipe.toml), the real ResultChecker; sequences are built here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from astraflow.config.load import load_recipe
from astraflow.dataflow.validate import ResultChecker
from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import Episode, PackedSequence, SamplingParams, Sequence

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


def _packed(seqs: list[Sequence]) -> list[PackedSequence] | None:
    """The sequences packed as a RaaS sends them; None when a value fits no packed type (a mask of -1)."""
    try:
        return [PackedSequence.of(s) for s in seqs]
    except ValueError:
        return None


def _check(checker: ResultChecker, episodes: list[Episode] | list[m.PackedEpisode]) -> str:
    return checker.check(episodes, expected={"main": N}, roles=ROLES, latest={"main": 3})


def test_a_clean_result_passes_the_whole_result_pass(checker: ResultChecker) -> None:
    seqs = [_seq(k) for k in range(N)]
    packed = _packed(seqs)
    assert packed is not None and checker._clean(packed, {"main"}, {"main": 3}, {})
    assert _check(checker, [Episode(sequences=[s]) for s in seqs]) == ""


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("where", [0, 9, N - 1])
def test_a_fault_anywhere_gets_the_answer_of_the_walk(
    checker: ResultChecker, monkeypatch: pytest.MonkeyPatch, fault: str, where: int
) -> None:
    seqs = [_seq(k) for k in range(N)]
    seqs[where] = FAULTS[fault](seqs[where])
    episodes = [Episode(sequences=[s]) for s in seqs]
    packed = _packed(seqs)
    assert packed is None or not checker._clean(packed, {"main"}, {"main": 3}, {})
    got = _check(checker, episodes)
    assert got.startswith(f"episode {where} sequence 0: "), got
    with monkeypatch.context() as mp:  # the walk alone
        mp.setattr(ResultChecker, "_clean", lambda *_a, **_k: False)
        assert _check(checker, episodes) == got


def _raw(**fields: bytes) -> Callable[[PackedSequence], PackedSequence]:
    return lambda s: msgspec.structs.replace(s, **fields)


PACKED_FAULTS: dict[str, tuple[Callable[[PackedSequence], PackedSequence], str]] = {
    "tokens of 7 bytes": (_raw(tokens=b"\x01" * 7), "tokens is 7 bytes, not a whole number of 4-byte items"),
    "versions of 18 bytes": (_raw(versions=b"\x00" * 18), "versions is 18 bytes"),
    "logprobs of 3 bytes": (_raw(logprobs=b"\x00" * 3), "logprobs is 3 bytes"),
    "a mask one byte long": (_raw(loss_mask=b"\x00\x00\x00\x01\x01\x01"), "lengths differ (5/6/5/5)"),
    "tokens as float32": (_raw(tokens=PackedSequence.of(_seq(0)).logprobs), "outside the vocabulary"),
    "a NaN logprob": (_raw(logprobs=b"\x00\x00\xc0\x7f" * 5), "logprobs must be finite"),
}


@pytest.mark.parametrize("fault", sorted(PACKED_FAULTS))
@pytest.mark.parametrize("where", [0, N - 1])
def test_a_malformed_packed_field_is_named_as_the_walk_names_it(
    checker: ResultChecker, monkeypatch: pytest.MonkeyPatch, fault: str, where: int
) -> None:
    plant, words = PACKED_FAULTS[fault]
    result = m.TaskResult(task_id=1, epoch=1, episodes=[Episode(sequences=[_seq(k)]) for k in range(N)])
    bad = result.episodes[where].sequences[0]
    result.episodes[where].sequences[0] = plant(bad)
    decoded = decode(encode(result))  # as the controller receives it: the bytes travel as they are
    assert isinstance(decoded, m.TaskResult)
    got = _check(checker, decoded.episodes)
    assert got.startswith(f"episode {where} sequence 0: ") and words in got, got
    with monkeypatch.context() as mp:  # the walk alone
        mp.setattr(ResultChecker, "_clean", lambda *_a, **_k: False)
        assert _check(checker, decoded.episodes) == got


def test_a_value_no_packed_type_holds_is_refused_when_packed() -> None:
    with pytest.raises(ValueError, match="episode 0 sequence 0: loss_mask"):
        m.Outcome(task_id=1, epoch=1, episodes=[Episode(sequences=[FAULTS["mask of -1"](_seq(0))])])
    with pytest.raises(ValueError, match="tokens: .*int32"):
        PackedSequence.of(msgspec.structs.replace(_seq(0), tokens=[1, 2, 3, 4, 2**40]))


def test_a_list_where_packed_bytes_belong_fails_decoding() -> None:
    """A peer of protocol 5 or earlier (lists of numbers) or a forger gets bad_message, not a crash."""
    raw = msgspec.msgpack.decode(
        encode(m.TaskResult(task_id=1, epoch=1, episodes=[Episode(sequences=[_seq(0)])]))
    )
    raw["episodes"][0]["sequences"][0]["tokens"] = [1, 2, 3, 4, 5]
    with pytest.raises(DecodeError) as err:
        decode(msgspec.msgpack.encode(raw))
    assert err.value.code == "bad_message" and "Expected `bytes`, got `array`" in str(err.value)


def test_recorded_turns_that_fit_keep_a_result_on_the_whole_result_pass(checker: ResultChecker) -> None:
    """Multi-turn transcripts record their turns: checked against the packed mask, no walk needed."""
    seqs = [msgspec.structs.replace(_seq(k), turns=[(3, 2, k % 2 == 0)]) for k in range(N)]
    packed = _packed(seqs)
    assert packed is not None and checker._clean(packed, {"main"}, {"main": 3}, {})
    assert _check(checker, [Episode(sequences=[s]) for s in seqs]) == ""


@pytest.mark.parametrize(
    "fault", ["negative token", "nan logprob", "future version", "other top_k", "too long"]
)
def test_results_checked_together_clear_only_what_each_alone_passes(
    checker: ResultChecker, fault: str
) -> None:
    """A group commit's results are checked from the message's columns in one pass per (roles, task
    overrides) (clear_columns): a fault in one result clears none of its pass, the others' pass is
    cleared, and each result's answer is the one it gets alone."""
    results = [[Episode(sequences=[_seq(k)]) for k in range(4)] for _ in range(4)]
    results[2][1].sequences[0] = FAULTS[fault](results[2][1].sequences[0])
    overrides: list[dict[str, float | int]] = [{}, {}, {"temperature": 1.0}, {"temperature": 1.0}]
    msg = m.TaskResults.of([m.Outcome(task_id=i, epoch=1, episodes=eps) for i, eps in enumerate(results)])
    view = ResultColumns(decode(encode(msg)))
    assert view.problem == ""
    flags = checker.clear_columns(view, [(i, ROLES, overrides[i]) for i in range(4)], {"main": 3})
    assert flags == [True, True, False, False]
    for eps, sampling, cleared in zip(results, overrides, flags, strict=True):
        alone = checker.check(
            eps, expected={"main": N}, roles=ROLES, latest={"main": 3}, task_sampling=sampling
        )
        got = checker.check(
            eps,
            expected={"main": N},
            roles=ROLES,
            latest={"main": 3},
            task_sampling=sampling,
            cleared=cleared,
        )
        assert got == alone
    assert _check(checker, results[2]).startswith("episode 1 sequence 0: ")

"""Advantage estimators (RLOO, REINFORCE++ with baseline) against values worked out by hand, and their
path through the pipeline: group stage when a group is stored, batch stage when a batch is served."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from astraflow.config.load import validate_plugins
from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.estimators import (
    AdvantageEstimator,
    ReinforcePPConfig,
    estimator_class,
    make_estimator,
)
from astraflow.dataflow.pipeline import Pipeline
from astraflow.errors import PluginError, RecipeError
from astraflow.protocol.messages import Episode, SamplingParams, Sequence
from astraflow.protocol.sample_columns import cut
from astraflow.state.store import Store


def test_rloo_by_hand() -> None:
    rloo = make_estimator("rloo")
    # [1, 0, 0, 1]: the others of a 1 average 1/3, of a 0 average 2/3.
    assert rloo.group([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-15)
    # [3, 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2 (= n / (n - 1) * (r - mean) with mean 2).
    assert rloo.group([3.0, 1.0, 2.0]) == pytest.approx([1.5, -1.5, 0.0], abs=1e-15)
    assert rloo.group([0.5, -0.25]) == pytest.approx([0.75, -0.75], abs=1e-15)
    # no baseline for a singleton; equal rewards give zeros
    assert rloo.group([0.7]) == [0.0]
    assert rloo.group([0.3, 0.3, 0.3]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-15)
    assert rloo.group([]) == []


def test_reinforce_pp_by_hand() -> None:
    est = make_estimator("reinforce_pp")
    assert est.batch_level
    # group stage: r - group mean
    g1 = est.group([1.0, 0.0, 0.0, 1.0])
    g2 = est.group([1.0, 1.0])
    g3 = est.group([2.0, 0.0])
    assert g1 == [0.5, -0.5, -0.5, 0.5] and g2 == [0.0, 0.0] and g3 == [1.0, -1.0]
    # batch stage over [0.5, -0.5, -0.5, 0.5, 0, 0, 1, -1]: mean 0, population variance
    # (4 * 0.25 + 2 * 1) / 8 = 0.375.
    out = est.batch(g1 + g2 + g3)
    std = math.sqrt(0.375)
    want = [a / (std + 1e-5) for a in (0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 1.0, -1.0)]
    assert out == pytest.approx(want, abs=1e-12)
    # a batch whose mean is not 0: [1, 2, 3] -> mean 2, std sqrt(2/3)
    out = est.batch([1.0, 2.0, 3.0])
    s = math.sqrt(2 / 3) + 1e-5
    assert out == pytest.approx([-1 / s, 0.0, 1 / s], abs=1e-12)
    # eps option; a batch of equal advantages (or one sequence) is all zeros
    wide = make_estimator("reinforce_pp", {"eps": 0.5})
    assert wide.batch([1.0, 3.0]) == pytest.approx([-1 / 1.5, 1 / 1.5], abs=1e-12)
    assert est.batch([0.4]) == [0.0] and est.batch([0.2, 0.2]) == [0.0, 0.0] and est.batch([]) == []


def test_builtin_grpo_matches_and_group_only_estimators_leave_batches_alone() -> None:
    grpo = make_estimator("grpo")
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-5)
    assert grpo.group([1.0, 0.0, 0.0, 1.0]) == pytest.approx([expected, -expected, -expected, expected])
    assert make_estimator("drgrpo").group([1.0, 0.0]) == [0.5, -0.5]
    for name in ("grpo", "drgrpo", "rloo"):
        est = make_estimator(name)
        assert not est.batch_level and est.batch([1.0, -3.0]) == [1.0, -3.0]


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp"])
def test_large_rewards_stay_finite_and_non_finite_are_refused(name: str) -> None:
    est = make_estimator(name)
    big = [1e300, -1e300, 5e299, 0.0]
    adv = est.group(big)
    assert all(math.isfinite(a) for a in adv)
    # the same answer as for the rewards scaled down by 1e300, scaled back up
    small = est.group([1.0, -1.0, 0.5, 0.0])
    assert adv == pytest.approx([a * 1e300 for a in small], rel=1e-12)
    # a naive sum of [1.7e308, 1.7e308] overflows; the scaled one does not
    assert est.group([1.7e308, 1.7e308]) == [0.0, 0.0]
    assert all(math.isfinite(a) for a in est.batch(adv))
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="non-finite"):
            est.group([1.0, bad])


def test_unknown_estimator_and_bad_options_are_clear() -> None:
    with pytest.raises(PluginError, match="no advantage estimator named 'ppo'") as err:
        estimator_class("ppo")
    assert "rloo" in (err.value.hint or "")
    with pytest.raises(RecipeError, match="takes no options"):
        make_estimator("rloo", {"eps": 1.0})
    with pytest.raises(RecipeError, match="advantage_options.eps"):
        make_estimator("reinforce_pp", {"eps": -1.0})
    rec = Recipe(
        workflow={"name": "quickstart"},
        policy=[PolicyConfig(model="m", advantage="nope")],  # type: ignore[arg-type]
    )
    with pytest.raises(PluginError, match="no advantage estimator named 'nope'"):
        validate_plugins(rec, torch_plugins=False)


def _episodes(rewards: list[float]) -> list[Episode]:
    return [
        Episode(
            sequences=[
                Sequence(
                    policy="main",
                    tokens=[0, 1, 2],
                    loss_mask=[0, 1, 1],
                    logprobs=[0.0, -1.0, -1.0],
                    versions=[-1, 0, 0],
                    reward=r,
                    sampling=SamplingParams(),
                )
            ]
        )
        for r in rewards
    ]


def test_reinforce_pp_through_the_pipeline(tmp_path: Path) -> None:
    """Group stage when a task is stored (the buffer keeps r - mean), batch stage on the served batch;
    the same recorded batch served again reaches the trainer with the same advantages."""
    store = Store.open(tmp_path / "s.db")
    rec = Recipe(
        policy=[PolicyConfig(model="m", group_size=2, batch_prompts=2, advantage="reinforce_pp")]  # type: ignore[arg-type]
    )
    pipe = Pipeline(rec.policy, store, seed=rec.run.seed)
    buf = Buffer(store, order=pipe.order)
    pipe.ingest(buf, 1, "a", _episodes([1.0, 0.0]))
    pipe.ingest(buf, 2, "b", _episodes([3.0, 3.0]))
    batch = buf.next_batch("main", 1, 4, 1, 0)
    assert batch is not None
    stored = sorted(s.advantage for s in batch.samples)
    assert stored == [-0.5, 0.0, 0.0, 0.5]
    served = cut(pipe.batch_columns("main", batch.columns))
    # [0.5, -0.5, 0, 0]: mean 0, population std sqrt(0.125)
    s = math.sqrt(0.125) + 1e-5
    assert sorted(x.advantage for x in served) == pytest.approx([-0.5 / s, 0.0, 0.0, 0.5 / s], abs=1e-12)
    assert [x.traj_id for x in served] == [x.traj_id for x in batch.samples]
    again = buf.next_batch("main", 1, 4, 1, 0)
    assert again is not None and not again.new
    assert [x.advantage for x in cut(pipe.batch_columns("main", again.columns))] == [
        x.advantage for x in served
    ]
    store.close()


def test_rloo_through_the_pipeline_and_a_plugin_subclass(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    rec = Recipe(policy=[PolicyConfig(model="m", group_size=3, advantage="rloo")])  # type: ignore[arg-type]
    pipe = Pipeline(rec.policy, store, seed=rec.run.seed)
    buf = Buffer(store, order=pipe.order)
    pipe.ingest(buf, 1, "a", _episodes([3.0, 1.0, 2.0]))
    batch = buf.next_batch("main", 1, 3, 1, 0)
    assert batch is not None
    by_reward = {s.reward: s.advantage for s in cut(pipe.batch_columns("main", batch.columns))}
    assert by_reward == pytest.approx({3.0: 1.5, 1.0: -1.5, 2.0: 0.0})
    store.close()

    class Const(AdvantageEstimator):
        def group(self, rewards: list[float]) -> list[float]:
            return [1.0] * len(rewards)

    assert Const().group([0.0, 5.0]) == [1.0, 1.0] and isinstance(ReinforcePPConfig(), ReinforcePPConfig)


def test_a_group_the_estimator_refuses_is_refused_whole(tmp_path: Path) -> None:
    from astraflow.dataflow.limits import RefusedResult

    store = Store.open(tmp_path / "s.db")
    rec = Recipe(policy=[PolicyConfig(model="m", group_size=2, advantage="rloo")])  # type: ignore[arg-type]
    pipe = Pipeline(rec.policy, store, seed=rec.run.seed)
    buf = Buffer(store, order=pipe.order)
    with pytest.raises(RefusedResult, match="non-finite"):
        pipe.ingest(buf, 1, "a", _episodes([1.0, math.inf]))
    assert buf.counts("main") == {"buffered": 0, "consumed": 0, "expired": 0, "dropped": 0}
    store.close()

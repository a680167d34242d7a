"""Pipeline: stages built from the recipe, called at each point of the data path, state saved and reloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.config.recipe import PolicyConfig, Recipe, StageSpec
from astraflow.data.base import (
    AdmissionStage,
    BatchComposer,
    BufferItem,
    BufferOrder,
    Curator,
    GroupFilter,
    GroupView,
    Stage,
    StageConfig,
)
from astraflow.data.order import EdfOrder, FifoOrder
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.pipeline import Pipeline
from astraflow.errors import RecipeError
from astraflow.protocol.messages import Episode, SamplingParams, Sequence
from astraflow.state.store import Store


class SkipConfig(StageConfig):
    """Options of the test curator."""

    every: int = 2
    """Skip every n-th offered prompt."""


class SkipCurator(Curator):
    """Skips every n-th prompt; remembers rewards and versions it saw."""

    Config = SkipConfig

    def __init__(self, config: SkipConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self.offered = 0
        self.seen: dict[str, list[float]] = {}
        self.versions: list[int] = []

    def submit(self, key: str, sample: dict[str, Any]) -> bool:
        self.offered += 1
        return self.offered % self.config.every != 0

    def observe(self, key: str, rewards: list[float]) -> None:
        self.seen[key] = list(rewards)

    def on_version(self, version: int) -> None:
        self.versions.append(version)

    def state_dict(self) -> dict[str, Any]:
        return {"offered": self.offered, "versions": self.versions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offered, self.versions = state["offered"], list(state["versions"])

    def metrics(self) -> dict[str, float]:
        return {"offered": float(self.offered)}


class VarianceFilter(GroupFilter):
    """Drops groups whose rewards are all equal."""

    def keep(self, group: GroupView) -> bool:
        return max(group.rewards) != min(group.rewards)


class LongestFirst(BufferOrder):
    """Serves the longest sequence first."""

    def sort_key(self, item: BufferItem) -> tuple[Any, ...]:
        return (-item.length, item.arrival)


class HalfReplay(BatchComposer):
    """Replays half of each batch."""

    def replay_count(self, batch_size: int) -> int:
        return batch_size // 2


class TwoGroups(AdmissionStage):
    """Admits while fewer than two groups are outstanding."""

    def budget(self, outstanding: int, batch_size: int) -> int:
        return max(0, 2 - outstanding)


STAGES: dict[str, type[Stage]] = {
    "skip": SkipCurator,
    "variance": VarianceFilter,
    "longest": LongestFirst,
    "half_replay": HalfReplay,
    "two_groups": TwoGroups,
}


def _recipe(stages: list[StageSpec], order: str = "edf") -> Recipe:
    return Recipe(
        policy=[PolicyConfig(name="main", model="m", group_size=2, batch_prompts=1, order=order, data=stages)]
    )  # type: ignore[arg-type]


def _episode(rewards: list[float], n_tokens: int = 2) -> list[Episode]:
    return [
        Episode(
            sequences=[
                Sequence(
                    policy="main",
                    tokens=[0] * (n_tokens + 1),
                    loss_mask=[0] + [1] * n_tokens,
                    logprobs=[0.0] * (n_tokens + 1),
                    versions=[-1] + [0] * n_tokens,
                    reward=r,
                    sampling=SamplingParams(),
                )
            ]
        )
        for r in rewards
    ]


def test_stages_are_built_validated_and_placed(tmp_path: Path) -> None:
    rec = _recipe(
        [
            StageSpec(name="skip", options={"every": 3}),
            StageSpec(name="variance"),
            StageSpec(name="longest"),
            StageSpec(name="half_replay"),
            StageSpec(name="two_groups"),
        ]
    )
    pipe = Pipeline(rec.policy, Store.open(tmp_path / "s.db"), seed=rec.run.seed, loader=STAGES.__getitem__)
    ps = pipe.policies["main"]
    assert isinstance(ps.curators[0], SkipCurator) and ps.curators[0].config.every == 3
    assert ps.curators[0].policy == "main" and isinstance(ps.filters[0], VarianceFilter)
    assert isinstance(pipe.order("main"), LongestFirst)
    assert pipe.replay_count("main", 8) == 4
    assert pipe.fresh_per_batch("main", 8) == 4  # admission budgets for the fresh half only
    assert pipe.replay_count("main", 6) == 2  # 3 asked; the fresh part is rounded up to whole groups of 2
    assert (
        pipe.group_room("main", 1) == 1 and pipe.group_room("main", 2) == 0
    )  # the stage's budget, in groups
    with pytest.raises(RecipeError):
        Pipeline(
            _recipe([StageSpec(name="skip", options={"nope": 1})]).policy,
            None,
            seed=0,
            loader=STAGES.__getitem__,
        )


def test_default_order_follows_policy_order() -> None:
    assert isinstance(
        Pipeline(_recipe([], "fifo").policy, None, seed=0, loader=STAGES.__getitem__).order("main"), FifoOrder
    )
    assert isinstance(
        Pipeline(_recipe([], "edf").policy, None, seed=0, loader=STAGES.__getitem__).order("main"), EdfOrder
    )
    assert Pipeline(_recipe([]).policy, None, seed=0).replay_count("main", 8) == 0


def test_curate_filter_ingest_and_state_roundtrip(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    rec = _recipe([StageSpec(name="skip"), StageSpec(name="variance")])
    pipe = Pipeline(rec.policy, store, seed=rec.run.seed, loader=STAGES.__getitem__)
    submitted = [pipe.submit(f"k{i}", {}, ["main"]) for i in range(4)]
    assert submitted == [True, False, True, False]
    buf = Buffer(store, order=pipe.order)
    kept = pipe.ingest(buf, 1, "k0", _episode([0.0, 1.0]))
    dropped = pipe.ingest(buf, 2, "k2", _episode([1.0, 1.0]))
    assert kept[0].kept and not dropped[0].kept and len(dropped[0].traj_ids) == 2
    assert buf.counts("main") == {"buffered": 2, "consumed": 0, "expired": 0, "dropped": 2}
    batch = buf.next_batch("main", 1, 2, 1, 0)
    assert [s.advantage for s in batch.samples] == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    cur = pipe.policies["main"].curators[0]
    assert cur.seen == {"k0": [0.0, 1.0], "k2": [1.0, 1.0]}
    pipe.on_version("main", 1)  # saves state
    met = pipe.metrics("main")
    assert (
        met["data/prompts_skipped"] == 2 and met["data/groups_dropped"] == 1 and met["data/skip/offered"] == 4
    )
    store.close()
    again = Pipeline(rec.policy, Store.open(tmp_path / "s.db"), seed=rec.run.seed, loader=STAGES.__getitem__)
    cur2 = again.policies["main"].curators[0]
    assert cur2.offered == 4 and cur2.versions == [1]
    assert again.metrics("main")["data/groups_kept"] == 1
    assert again.submit("k4", {}, ["main"]) is True and again.submit("k5", {}, ["main"]) is False


def test_unknown_policy_sequences_are_ignored(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    pipe = Pipeline(_recipe([]).policy, store, seed=0)
    eps = [
        Episode(
            sequences=[
                Sequence(
                    policy="ghost",
                    tokens=[1],
                    loss_mask=[1],
                    logprobs=[0.0],
                    versions=[0],
                    sampling=SamplingParams(),
                )
            ]
        )
    ]
    assert pipe.ingest(Buffer(store), 1, "k", eps) == []

"""Data-algorithm stage contracts. A policy's pipeline is the recipe's list of stages, applied in
order at four points of the data path: before rollout (Curator), after rollout (GroupFilter), in the
buffer (BufferOrder) and at batching (BatchComposer). Stages run inside the controller: no torch.
Each stage's state is saved in the run's state store (state_dict / load_state_dict) and its
counters (metrics) are written to the run's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class StageConfig(BaseModel):
    """Base of every stage's options."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass
class GroupView:
    """One finished group (one prompt, one policy) as post-rollout stages see it."""

    task_id: int
    prompt_key: str
    policy: str
    rewards: list[float]
    advantages: list[float]
    lengths: list[int]
    """Generated tokens per sequence (all of its policy turns together)."""
    truncated: list[bool] = field(default_factory=list)
    """Whether any policy turn of each sequence hit max_new_tokens without a stop token."""
    info: list[dict[str, Any]] = field(default_factory=list)
    turn_lengths: list[list[int]] = field(default_factory=list)
    """Generated tokens of each policy turn, per sequence (a single-turn sequence has one entry)."""
    turn_truncated: list[list[bool]] = field(default_factory=list)
    """Truncation of each policy turn, per sequence."""


@dataclass
class BufferItem:
    """One trajectory waiting in (or consumed from) a policy's buffer."""

    traj_id: int
    task_id: int
    min_version: int
    """Oldest token version of the sequence."""
    arrival: int
    """Monotonic arrival order."""
    reward: float
    advantage: float
    length: int


class Stage:
    """Base of all stages; `kind` says where in the data path it runs."""

    Config: ClassVar[type[StageConfig]] = StageConfig
    kind: ClassVar[str] = ""

    counters: ClassVar[tuple[str, ...]] = ()
    """Names of the cumulative counters in `self.counts`; the defaults below save and report them."""

    def __init__(self, config: StageConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        self.config = config if config is not None else self.Config()
        self.policy = policy
        self.seed = seed
        self.counts: dict[str, int] = dict.fromkeys(self.counters, 0)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state, saved in the state store (by default: the counters)."""
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.counts = {
            **dict.fromkeys(self.counters, 0),
            **{k: int(v) for k, v in state.get("counts", {}).items()},
        }

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (submitted, skipped, filtered, replayed, ...)."""
        return {k: float(v) for k, v in self.counts.items()}


class Curator(Stage):
    """Before rollout: decides which prompts are submitted."""

    kind = "curator"

    def submit(self, key: str, sample: dict[str, Any]) -> bool:
        """True to submit this prompt now, False to skip it this time."""
        return True

    def observe(self, key: str, rewards: list[float]) -> None:
        """Feedback: the rewards of a finished group of this prompt."""

    def on_version(self, version: int) -> None:
        """Called once per new policy version."""


class GroupFilter(Stage):
    """After rollout: keeps or drops whole groups before they reach the buffer."""

    kind = "filter"

    def keep(self, group: GroupView) -> bool:
        """True to keep the group."""
        return True


class BufferOrder(Stage):
    """In the buffer: the order in which trajectories are served."""

    kind = "order"

    def sort_key(self, item: BufferItem) -> tuple[Any, ...]:
        """Items with smaller keys are served first."""
        return (item.arrival,)


class BatchComposer(Stage):
    """At batching: how many of a batch's sequences are replayed from recently consumed ones."""

    kind = "batch"

    def replay_count(self, batch_size: int) -> int:
        """Sequences of this batch to take from the replay pool (the rest are fresh). Pure: admission
        also asks it, to know how many fresh sequences a batch consumes."""
        return 0

    def on_batch(self, replayed: int) -> None:
        """Called once per newly recorded batch with the sequences actually replayed in it."""


class AdmissionStage(Stage):
    """Before submission: bounds how much work is outstanding so that nothing produced goes stale.

    The pipeline asks `admit` before it queues another prompt. `outstanding` and `batch_size` count the
    same unit (groups, i.e. prompts, is what the pipeline uses): every group queued, leased, or finished
    but not yet consumed by a training step of this policy.
    """

    kind = "admission"

    @property
    def max_staleness(self) -> int:
        """The staleness bound this stage admits for."""
        return 0

    def bind(self, policy_max_staleness: int) -> None:
        """Tell the stage the policy's own bound (PolicyConfig.max_staleness); called once at start."""

    def budget(self, outstanding: int, batch_size: int) -> int:
        """How many more groups may be admitted now (0 = wait for a training step)."""
        return 1 << 62

    def admit(self, outstanding: int, batch_size: int) -> bool:
        """True when one more group may be queued now."""
        return self.budget(outstanding, batch_size) > 0


def zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when every reward of a group is equal (within tol): every group advantage is zero."""
    return not rewards or max(rewards) - min(rewards) <= tol

"""The Workflow contract: one coroutine turns a sample into an Episode, calling policies by role."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol

from pydantic import BaseModel

from astraflow.engines.base import Completion
from astraflow.protocol.messages import Episode, SamplingParams, Sequence

__all__ = ["Episode", "Sequence", "PolicyClient", "Workflow", "completion_sequence"]


class PolicyClient(Protocol):
    """What a workflow sees of one policy: a tokenizer and a generate call."""

    policy: str
    tokenizer: Any
    """A transformers tokenizer of the policy's model."""
    group_size: int
    """The policy's group size in this task (samples compared with each other)."""
    read_only: bool
    """True when this task's sequences of the policy are not kept (frozen, budget met, or no room):
    a workflow may then generate less with it (e.g. fewer samples) where that is all it needs."""

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        """Sample n completions of prompt_ids with the recipe's sampling settings (overridable by
        SAMPLING_OVERRIDES keys); each completion carries the SamplingParams its engine used."""
        ...

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The settings a generate call with these overrides asks for (to decide before generating,
        e.g. whether a conversation can continue; a Sequence records the completion's own)."""
        ...


class Workflow(ABC):
    """An agent workflow / environment with its reward. Subclasses set Config and roles."""

    Config: type[BaseModel]
    """Options model (recipe: workflow.options)."""
    roles: tuple[str, ...] = ("actor",)
    """Roles this workflow calls; the recipe maps each to a policy."""
    optional_roles: tuple[str, ...] = ()
    """Roles the recipe may leave unmapped; the workflow sees only the mapped ones."""
    any_roles: bool = False
    """True: `workflow.roles` may map any role names (at least one); `roles` is then only the default."""
    baseline_per_role: bool = True
    """One policy in several roles (self-play): True gives each role its own group and baseline."""

    def __init__(self, config: BaseModel) -> None:
        self.config = config

    def close(self) -> None:
        """Release what the workflow started (verifier processes, sandboxes, game engines); the RaaS
        calls it once as it stops. Default: nothing to release."""
        return None

    @abstractmethod
    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """Prompt samples when the recipe names no dataset file; runs in the controller (no torch)."""

    @abstractmethod
    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Play one episode of `sample`; the returned sequences carry rewards."""

    async def run_group(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], group_sizes: dict[str, int]
    ) -> list[Episode]:
        """All episodes of one task; `group_sizes` maps role -> its policy's group size.

        Default: max(group sizes) episodes of run_episode, and each role keeps its sequences from its
        first group-size episodes (the others' are dropped), so every policy gets its own group size.
        Override to build groups differently (and say so in `sequences_per_task`)."""
        import asyncio

        n = max(group_sizes.values(), default=1)
        episodes = list(await asyncio.gather(*(self.run_episode(dict(sample), policies) for _ in range(n))))
        if len(set(group_sizes.values())) <= 1:
            return episodes
        by_policy = {c.policy: group_sizes.get(r, n) for r, c in policies.items()}
        for i, ep in enumerate(episodes):
            ep.sequences = [s for s in ep.sequences if i < by_policy.get(s.policy, n)]
        # an episode whose only sequences were trimmed (e.g. the larger group's role was skipped in it)
        # has nothing to keep; an empty episode would make the whole result invalid
        return [ep for ep in episodes if ep.sequences]

    @classmethod
    def sequences_per_task(cls, group_sizes: dict[str, int]) -> dict[str, int]:
        """Sequences each role yields per task (admission counts with it); default: its group size."""
        return dict(group_sizes)


def completion_sequence(
    client: PolicyClient,
    prompt_ids: list[int],
    completion: Completion,
    *,
    reward: float,
    role: str = "",
    group_key: str = "",
) -> Sequence:
    """The Sequence of one single-turn completion: prompt masked out, the completion's logprobs,
    versions and sampling settings carried, so the trainer recomputes under the same distribution."""
    n = len(prompt_ids)
    gen = list(completion.token_ids)
    return Sequence(
        policy=client.policy,
        tokens=list(prompt_ids) + gen,
        loss_mask=[0] * n + [1] * len(gen),
        logprobs=[0.0] * n + [float(x) for x in completion.logprobs],
        versions=[-1] * n + [int(v) for v in completion.versions],
        reward=float(reward),
        sampling=completion.sampling,
        role=role,
        group_key=group_key,
    )

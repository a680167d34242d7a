"""What a workflow sees of a policy on a rollout worker: a client that generates with its engine under
the recipe's sampling settings, and one task's view of it (group size, the task's overrides, seeds)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from astraflow.config.recipe import SamplingConfig
from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine
from astraflow.protocol.messages import SamplingParams


@dataclass
class EnginePolicyClient:
    """The PolicyClient a workflow sees: one policy's tokenizer and engine, with recipe sampling."""

    policy: str
    tokenizer: Any
    engine: RolloutEngine
    sampling: SamplingConfig
    stop_ids: list[int]

    group_size: int = 1

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        """Sample n completions with the recipe's sampling settings (overridable per call); each
        completion carries the settings the engine reports it used (never rewritten here)."""
        from astraflow.workflows.transcript import check_overrides

        check_overrides(overrides)
        req = GenerationRequest(
            prompt_ids=list(prompt_ids),
            max_new_tokens=int(overrides.get("max_new_tokens", self.sampling.max_new_tokens)),
            sampling=self.sampling_params(**overrides),
            stop_ids=list(overrides.get("stop_ids", self.stop_ids)),
            seed=overrides.get("seed"),  # the engine's own stream when None
        )
        # One n-sample call, so an engine can prefill the prompt once for the whole group.
        return await self.engine.generate_n(req, n) if n > 1 else await self.engine.generate([req])

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The settings a generate call with these overrides asks the engine for."""
        return SamplingParams(
            temperature=float(overrides.get("temperature", self.sampling.temperature)),
            top_p=float(overrides.get("top_p", self.sampling.top_p)),
            top_k=int(overrides.get("top_k", self.sampling.top_k)),
        )


def sample_seed(run_seed: int, task_id: int, role: str, call: int) -> int:
    """The sampling seed of a task's `call`-th generate call for `role`: a 48-bit hash of the four, so
    a task samples the same tokens from the same weights whichever worker runs it, whenever, and next
    to whatever else (sample i of an n-sample call uses seed + i)."""
    digest = hashlib.blake2b(f"{run_seed}:{task_id}:{role}:{call}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


@dataclass
class TaskPolicyClient:
    """One task's view of a policy: its group size in the task and the task's sampling overrides."""

    base: EnginePolicyClient
    group_size: int
    read_only: bool = False
    defaults: dict[str, Any] | None = None
    """Sampling overrides the task carries (an eval task's), under the workflow's own."""
    seeds: tuple[int, int, str] | None = None
    """(run seed, task id, role): each generate call without a seed of its own gets sample_seed of
    them and its call index; None leaves the engine's own stream."""
    calls: int = 0

    @property
    def policy(self) -> str:
        """The policy's name."""
        return self.base.policy

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer."""
        return self.base.tokenizer

    @property
    def sampling(self) -> SamplingConfig:
        """The recipe's sampling settings of the policy (what generate uses without overrides)."""
        return self.base.sampling

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        """The engine client's generate, with the task's overrides under the workflow's own and, without
        a seed, the task's next one."""
        merged = {**(self.defaults or {}), **overrides}
        if self.seeds is not None and merged.get("seed") is None:
            merged["seed"] = sample_seed(*self.seeds, self.calls)
        self.calls += 1
        return await self.base.generate(prompt_ids, n, **merged)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The settings a generate call with these overrides asks the engine for."""
        return self.base.sampling_params(**{**(self.defaults or {}), **overrides})

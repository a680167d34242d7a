"""The sampling settings a result may claim: those its task asked for, or a per-call override inside
the bounds the recipe sets for the policy.

A Sequence carries the SamplingParams its engine reported, and the trainer recomputes logprobs under
them. A buggy or forged result could claim settings nobody allowed (a temperature of 1e-300 makes the
trainer's loss NaN from the first step; a top-k nobody configured trains on a distribution no engine of
the run samples from), so the controller checks every sequence's settings against its task before
anything is recorded. This says which settings are allowed, not that the engine really used them: a
worker that lies within the bounds is not caught here.
"""

from __future__ import annotations

from collections.abc import Mapping

from astraflow.config.recipe import SamplingConfig
from astraflow.protocol.messages import SamplingParams


def task_params(policy: SamplingConfig, task: Mapping[str, float | int]) -> SamplingParams:
    """The settings a task asks of a policy: its recipe sampling under the task's overrides
    (eval.sampling on an evaluation task)."""
    return SamplingParams(
        temperature=float(task.get("temperature", policy.temperature)),
        top_p=float(task.get("top_p", policy.top_p)),
        top_k=int(task.get("top_k", policy.top_k)),
    )


def sampling_problem(claimed: SamplingParams, policy: SamplingConfig, task: Mapping[str, float | int]) -> str:
    """Why a sequence's claimed settings are not allowed by its task ('' when they are)."""
    if not isinstance(claimed, SamplingParams):
        return f"sampling {claimed!r} is not a SamplingParams"
    why = claimed.problem()
    if why:
        return why
    asked = task_params(policy, task)
    if claimed == asked:
        return ""
    bounds = policy.overrides
    lo, hi = bounds.temperature
    if claimed.temperature != asked.temperature and not lo <= claimed.temperature <= hi:
        return (
            f"temperature {claimed.temperature} is neither the task's ({asked.temperature}) nor inside "
            f"policy.sampling.overrides.temperature [{lo}, {hi}]"
        )
    if claimed.top_p != asked.top_p and not bounds.top_p:
        return (
            f"top_p {claimed.top_p} differs from the task's ({asked.top_p}) and "
            "policy.sampling.overrides.top_p is false"
        )
    if claimed.top_k != asked.top_k and not bounds.top_k:
        return (
            f"top_k {claimed.top_k} differs from the task's ({asked.top_k}) and "
            "policy.sampling.overrides.top_k is false"
        )
    return ""

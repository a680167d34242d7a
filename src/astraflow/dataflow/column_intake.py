"""A result read from its message's columns stored without a Python object per sequence.

`Pipeline.ingest` walks a result's sequences to group them by (policy, role, group key). The
usual result is one group: every sequence of one policy, one group key and (for a policy whose
roles are grouped apart) one role. Such a result read from a TaskResults' columns
(protocol/columns.py) is grouped, its advantages computed and its rows queued straight from the
columns (`Buffer.insert_columns`); any other (several groups, a post-rollout filter that needs
each sequence's turns, an unknown or read-only policy) is turned back into an Outcome and goes
through `Pipeline.ingest`, so both paths store the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

import numpy as np

from astraflow.dataflow.advantages import checked_advantages, groups_advantages
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.estimators import AdvantageEstimator, DrGRPOEstimator, GRPOEstimator
from astraflow.dataflow.pipeline import GroupOutcome, Pipeline
from astraflow.protocol.columns import ResultColumns


def _one_group(pipeline: Pipeline, view: ResultColumns, i: int, skip: AbstractSet[str]) -> str | None:
    """The policy of result i's sequences when they form one group `ingest_columns` can store itself."""
    pol = view.group_policy[i]
    if pol is None:
        return None
    ps = pipeline.policies.get(pol)
    if ps is None or ps.filters or pol in skip:
        return None
    if pol in pipeline.split_roles and not view.uniform("role")[i]:
        return None
    return pol


_NONE: frozenset[str] = frozenset()


_KINDS: dict[type[AdvantageEstimator], str] = {GRPOEstimator: "grpo", DrGRPOEstimator: "drgrpo"}
"""The built-in estimators whose groups `plan_advantages` finds for a whole message (pure
functions of a group's rewards; a plugin's, even a subclass of these, keeps its own `group`)."""


PLAN_MIN_RESULTS = 3
"""Results a message needs for `plan_advantages` to find their groups' advantages at once: numpy's
passes cost 46 µs for one group of 16 where the estimator's own Python takes 27, and 8 µs a group
at four groups (each group left out is asked of its estimator, the same values)."""


def plan_advantages(pipeline: Pipeline, view: ResultColumns) -> dict[int, list[float]]:
    """Result index -> the advantages `checked_advantages` gives its group, for every result of the
    message whose sequences are one group of a policy with a built-in grpo or drgrpo estimator,
    found in numpy passes over the message's rewards (`groups_advantages`: the same values to the
    bit). A result with a non-finite reward or advantage is left out: `ingest_columns` asks the
    estimator, which refuses it, in the order the results come; so is every result of a message of
    fewer than PLAN_MIN_RESULTS."""
    if len(view.heads) < PLAN_MIN_RESULTS or not view.rewards_finite:
        return {}
    wanted: dict[str, list[int]] = {}
    for i, pol in enumerate(view.group_policy):
        ps = None if pol is None else pipeline.policies.get(pol)
        kind = None if ps is None or ps.estimator is None else _KINDS.get(type(ps.estimator))
        if kind is not None:
            wanted.setdefault(kind, []).append(i)
    if not wanted:
        return {}
    starts = view.starts
    # the results with sequences tile the rewards column; an empty one is no group
    tiled = [i for i in range(len(starts) - 1) if starts[i + 1] > starts[i]]
    at = {i: k for k, i in enumerate(tiled)}
    bounds = [starts[i] for i in tiled] + [starts[-1]]
    plan: dict[int, list[float]] = {}
    for kind, idx in wanted.items():
        groups = groups_advantages(view.rewards, bounds, kind)
        for i in idx:
            adv = groups[at[i]]
            if all(map(math.isfinite, adv)):
                plan[i] = adv
    return plan


def ingest_columns(
    pipeline: Pipeline,
    buffer: Buffer,
    task_id: int,
    prompt_key: str,
    view: ResultColumns,
    i: int,
    read_only: Iterable[str] = (),
    planned: dict[int, list[float]] | None = None,
) -> list[GroupOutcome]:
    """`Pipeline.ingest` of result i of a message read through its columns (`planned`: the
    advantages `plan_advantages` found for the message's results)."""
    skip = set(read_only) if read_only else _NONE
    pol = _one_group(pipeline, view, i, skip)
    if pol is None:
        return pipeline.ingest(buffer, task_id, prompt_key, view.outcome(i).episodes, read_only=skip)
    ps = pipeline.policies[pol]
    a, b = view.starts[i], view.starts[i + 1]
    rewards = view.reward_list[a:b]
    advantages = None if planned is None else planned.get(i)
    if advantages is None:
        advantages = checked_advantages(ps.estimator, pol, view.cols.keys[int(view.key[a])], rewards)
    head = view.heads[i]
    if head.infos:
        ends = np.cumsum([a, *head.episodes]).tolist()
        names = view.cols.names
        for e in sorted(head.infos):
            roles = {names[r] for r in view.role[ends[e] : ends[e + 1]].tolist()}
            pipeline.observe_info(head.infos[e], {(pol, r) for r in roles}, task_id)
    for cur in ps.curators:
        cur.observe(prompt_key, rewards)
    ps.counters["groups_kept"] += 1
    ids = buffer.insert_columns(task_id, prompt_key, (view, a, b), advantages, status="buffered")
    return [GroupOutcome(pol, ids, rewards, True)]

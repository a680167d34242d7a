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

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

import numpy as np

from astraflow.dataflow.advantages import checked_advantages
from astraflow.dataflow.buffer import Buffer
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


def ingest_columns(
    pipeline: Pipeline,
    buffer: Buffer,
    task_id: int,
    prompt_key: str,
    view: ResultColumns,
    i: int,
    read_only: Iterable[str] = (),
) -> list[GroupOutcome]:
    """`Pipeline.ingest` of result i of a message read through its columns."""
    skip = set(read_only) if read_only else _NONE
    pol = _one_group(pipeline, view, i, skip)
    if pol is None:
        return pipeline.ingest(buffer, task_id, prompt_key, view.outcome(i).episodes, read_only=skip)
    ps = pipeline.policies[pol]
    a, b = view.starts[i], view.starts[i + 1]
    rewards = view.reward_list[a:b]
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

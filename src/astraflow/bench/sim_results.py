"""What the bench's simulated workers answer (bench/control_sim.py, and the in-process drive of
bench/control_inproc.py): a task's group as trivial one-sequence episodes of a cached template, and a
grant's results as one TaskResults built as columns directly, the bytes `TaskResults.of` would pack."""

from __future__ import annotations

import functools
import random

import msgspec
import numpy as np

from astraflow.protocol import messages as m
from astraflow.protocol.packed import INT32


def episodes(
    task: m.Task, policy: str, version: int, rng: random.Random, tokens: int = 3
) -> list[m.PackedEpisode]:
    """The task's group as trivial one-sequence episodes: 3 prompt tokens, `tokens` generated, packed
    as a RaaS sends them (packed once per version and length: the simulator's own cost must stay small
    beside the controller's on a shared machine)."""
    n = task.group_sizes.get(policy, task.group_size) if task.group_sizes else task.group_size
    one = _template(policy, version, tokens)
    return [
        m.PackedEpisode(sequences=[msgspec.structs.replace(one, reward=float(rng.random() < 0.5))])
        for _ in range(n)
    ]


def results(
    tasks: list[m.Task], policy: str, version: int, rng: random.Random, tokens: int = 3
) -> m.TaskResults:
    """One TaskResults answering these tasks with `episodes`' groups, built as columns directly: the
    message `TaskResults.of` packs from them, to the byte (the same rewards drawn in the same order),
    without a Python object a sequence (at 4,096 sequences a message packing them took the simulator
    about as long as the controller's step, and the controller waited on it)."""
    one = _template(policy, version, tokens)
    sizes = [t.group_sizes.get(policy, t.group_size) if t.group_sizes else t.group_size for t in tasks]
    total = sum(sizes)
    zeros = np.zeros(total, INT32).tobytes()
    cols = m.SequenceColumns(
        lengths=np.full(total, len(one.loss_mask), INT32).tobytes(),
        tokens=one.tokens * total,
        loss_mask=one.loss_mask * total,
        logprobs=one.logprobs * total,
        versions=one.versions * total,
        rewards=np.array([float(rng.random() < 0.5) for _ in range(total)], "<f8").tobytes(),
        # pack's tables: the policy is the first name, the template's role ("") the second
        policy=zeros,
        role=np.ones(total, INT32).tobytes(),
        group_key=zeros,
        sampling=zeros,
        names=[policy, one.role],
        keys=[one.group_key],
        samplings=[one.sampling],
    )
    heads = [
        m.ResultHead(task_id=t.task_id, epoch=t.epoch, episodes=[1] * n)
        for t, n in zip(tasks, sizes, strict=True)
    ]
    return m.TaskResults(results=heads, columns=cols)


@functools.lru_cache(maxsize=8)
def _template(policy: str, version: int, tokens: int) -> m.PackedSequence:
    return m.PackedSequence.of(
        m.Sequence(
            policy=policy,
            tokens=[1, 2, 3] + [4 + i % 5 for i in range(tokens)],
            loss_mask=[0, 0, 0] + [1] * tokens,
            logprobs=[0.0, 0.0, 0.0] + [-0.5] * tokens,
            versions=[-1, -1, -1] + [version] * tokens,
            sampling=m.SamplingParams(),
        )
    )

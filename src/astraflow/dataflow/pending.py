"""The groups one message stores, written together: a group commit (`TaskResults`,
roles/controller/results.py) becomes one INSERT of trajectory rows and one of token_groups rows
(state/token_groups.py), with the oldest token version of every sequence found in one numpy pass,
instead of those statements and passes once per group.

Ids are handed out when a group is added: the controller is the only writer and the rows are
written in the same transaction, so SQLite gives them exactly the ids after the newest one
(`INTEGER PRIMARY KEY`); the write checks that it did. Nothing reads the trajectories of a pending
group before the block that collects them ends (the intake stores, then acknowledges).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.data.base import BufferItem
from astraflow.protocol import packed
from astraflow.protocol.messages import PackedSequence
from astraflow.state import trajectories
from astraflow.state.store import Store

_NONE = np.iinfo(np.int32).max


@dataclass
class Group:
    """One group's sequences (one policy) waiting to be written, with the ids they will get."""

    first_id: int
    task_id: int
    prompt_key: str
    seqs: list[PackedSequence]
    advantages: list[float]
    status: str


@dataclass
class Pending:
    """Groups added since the block began, and the id the next sequence gets."""

    next_id: int
    groups: list[Group] = field(default_factory=list)

    def add(
        self, task_id: int, prompt_key: str, seqs: list[PackedSequence], advantages: list[float], status: str
    ) -> list[int]:
        """Queue a group; the ids its sequences will have."""
        first = self.next_id
        self.groups.append(Group(first, task_id, prompt_key, seqs, advantages, status))
        self.next_id += len(seqs)
        return list(range(first, self.next_id))

    def write(self, store: Store) -> list[tuple[str, BufferItem]]:
        """Write every queued group: two statements in all (inside the caller's transaction); the
        buffered ones as (policy, item), as the buffer orders them."""
        if not self.groups:
            return []
        every = [s for g in self.groups for s in g.seqs]
        oldest = iter(min_versions(every))
        rows: list[tuple[Any, ...]] = []
        for g in self.groups:
            for k, (seq, adv) in enumerate(zip(g.seqs, g.advantages, strict=True)):
                sp = seq.sampling
                rows.append(
                    (
                        g.task_id,
                        seq.policy,
                        g.prompt_key,
                        float(seq.reward),
                        float(adv),
                        len(seq.loss_mask) - seq.loss_mask.count(0),
                        next(oldest),
                        g.first_id + k,  # arrival: ids only grow, so the id is the arrival order
                        g.status,
                        seq.role,
                        seq.group_key,
                        float(sp.temperature),
                        float(sp.top_p),
                        int(sp.top_k),
                    )
                )
        groups = [
            (g.first_id, [(s.tokens, s.loss_mask, s.logprobs, s.versions) for s in g.seqs])
            for g in self.groups
        ]
        trajectories.insert_groups(store, self.groups[0].first_id, rows, groups)
        # (traj_id, task_id, min_version, arrival, reward, advantage, length): arrival is the id
        return [
            (r[1], BufferItem(r[7], r[0], r[6], r[7], r[3], r[4], r[5])) for r in rows if r[8] == "buffered"
        ]


def min_versions(seqs: list[PackedSequence]) -> list[int]:
    """Oldest version among the tokens each sequence's policy generated (-1 when it generated none
    with a version: then the oldest version present, else -1), for many sequences at once: one numpy
    pass over their packed versions instead of Python numbers per token."""
    out = [-1] * len(seqs)
    idx = [i for i, s in enumerate(seqs) if s.loss_mask]
    if not idx:
        return out
    versions = np.frombuffer(b"".join([seqs[i].versions for i in idx]), packed.INT32)
    mask = np.frombuffer(b"".join([seqs[i].loss_mask for i in idx]), np.uint8) != 0
    starts = np.cumsum([0] + [len(seqs[i].loss_mask) for i in idx[:-1]])
    known = versions >= 0
    generated = np.minimum.reduceat(np.where(mask & known, versions, _NONE), starts).tolist()
    present = generated
    if _NONE in generated:  # a sequence with no versioned generated token: the oldest version present
        present = np.minimum.reduceat(np.where(known, versions, _NONE), starts).tolist()
    for k, i in enumerate(idx):
        oldest = generated[k] if generated[k] != _NONE else present[k]
        out[i] = oldest if oldest != _NONE else -1
    return out

"""The just-stored buffered groups, kept as their joined arrays so the batch that consumes them is
served as columns without reading them back from state.db or building an object per sequence
(dataflow/buffer.py).

Each stored group is one `Block` (protocol/sample_columns.py): its sequences' per-token arrays joined,
one bytes object per field (a slice of the message's columns, cut once), with its rewards,
advantages and sampling settings as arrays. A trajectory id maps to its group's block; a batch takes
runs of a group's consecutive sequences as one slice each. Bounded: FRESH_TOKENS tokens of blocks in
all, oldest dropped first; a block goes as soon as every sequence of it was taken. A miss reads the
store. The buffer clears it on a rollback: the ids of a rolled-back insert are reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import PackedSequence, SamplingParams
from astraflow.protocol.sample_columns import Block, Segment

FRESH_TOKENS = 262_144
"""Tokens of just-stored buffered groups kept in memory as joined arrays (a few MB), so that the batch
which consumes them is served without reading them back."""


class FreshSamples:
    """Trajectory id -> the block of its stored group, for buffered groups stored lately; `tokens` in all."""

    def __init__(self) -> None:
        self._at: dict[int, Block] = {}
        self._blocks: dict[int, Block] = {}
        """First id -> block, oldest first."""
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._at

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def remember(self, ids: list[int], seqs: list[PackedSequence], advantages: list[float]) -> None:
        """Keep a stored buffered group (consecutive ids) given one PackedSequence each."""
        block = Block.of_arrays(
            [(s.tokens, s.loss_mask, s.logprobs, s.versions) for s in seqs],
            [float(s.reward) for s in seqs],
            advantages,
            [_stored(s.sampling) for s in seqs],
            ids[0] if ids else 0,
        )
        self._keep(ids, block)

    def remember_columns(
        self, ids: list[int], view: ResultColumns, a: int, b: int, advantages: list[float]
    ) -> None:
        """`remember` of the stored sequences a..b-1 of a message's columns: the group's arrays are one
        slice of each of the message's joined columns."""
        tokens, mask, logprobs, versions = view.joined(a, b)
        tok = view.tok[a : b + 1] - view.tok[a]
        block = Block(
            tok=tok,
            tokens=tokens,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            rewards=view.rewards[a:b],
            advantages=np.array(advantages, np.float64),
            sampling=view.sampling[a:b],
            table=[_stored(sp) for sp in view.cols.samplings],
            first=ids[0] if ids else 0,
            left=b - a,
        )
        self._keep(ids, block)

    def _keep(self, ids: list[int], block: Block) -> None:
        if not ids:
            return
        assert ids[-1] - ids[0] == len(ids) - 1 == len(block) - 1, "a stored group's ids are consecutive"
        self._at.update(dict.fromkeys(ids, block))
        self._blocks[block.first] = block
        self.tokens += block.token_count
        while self.tokens > FRESH_TOKENS and self._blocks:
            self._drop(self._blocks[next(iter(self._blocks))])

    def _drop(self, block: Block) -> None:
        del self._blocks[block.first]
        self.tokens -= block.token_count
        for i in range(block.first, block.first + len(block)):
            self._at.pop(i, None)

    def forget(self) -> None:
        """Drop every kept group."""
        self._at.clear()
        self._blocks.clear()
        self.tokens = 0

    def take(self, ids: list[int]) -> list[Segment | int]:
        """Remove these ids; return, in their order, runs of kept consecutive sequences of one block
        as (block, k0, k1), and each id not kept as itself."""
        out: list[Segment | int] = []
        at = self._at
        last: Block | None = None
        end = -1
        for i in ids:
            block = at.pop(i, None)
            if block is None:
                out.append(i)
                last = None
                continue
            k = i - block.first
            if block is last and k == end:
                b, k0, _ = out[-1]  # type: ignore[misc]
                out[-1] = (b, k0, k + 1)
            else:
                out.append((block, k, k + 1))
            last, end = block, k + 1
            block.left -= 1
            if not block.left:
                self._blocks.pop(block.first, None)
                self.tokens -= block.token_count
        return out


def _stored(sp: SamplingParams) -> SamplingParams:
    """The settings as state.db gives them back (floats, an int): what a batch read back carries."""
    return sampling(float(sp.temperature), float(sp.top_p), int(sp.top_k))


@lru_cache(maxsize=64)
def sampling(temperature: float, top_p: float, top_k: int) -> SamplingParams:
    """The (frozen, so shareable) settings of stored samples: a batch has one or a few distinct ones."""
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)

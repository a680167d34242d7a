"""The just-stored buffered groups, kept as their joined arrays so the batch that consumes them is
served as columns without reading them back from state.db or building an object per sequence
(dataflow/buffer.py).

Each stored group is one `Block` (protocol/sample_columns.py): its sequences' per-token arrays joined,
one bytes object per field (a slice of the message's columns, cut once), with its rewards,
advantages and sampling settings beside them. A trajectory id maps to its group's block; a batch takes
runs of a group's consecutive sequences as one chunk each. Bounded: FRESH_TOKENS tokens of blocks in
all, oldest dropped first; a block goes as soon as every sequence of it was taken. A miss reads the
store. The buffer clears it on a rollback: the ids of a rolled-back insert are reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from itertools import repeat

import numpy as np

from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import PackedSequence, SamplingParams
from astraflow.protocol.sample_columns import Array, Block, Segment

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
        self._samplings: list[SamplingParams] | None = None
        self._table: list[SamplingParams] = []
        """The sampling settings of the newest message's columns, as stored."""

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
        tok = view.tok[a : b + 1]
        if self._samplings is not view.cols.samplings:  # a message's settings as stored, once a message
            self._samplings = view.cols.samplings
            self._table = [_stored(sp) for sp in self._samplings]
        block = Block(
            tok=(tok - tok[0]).tolist(),
            lengths=view.lengths[a:b],
            tokens=tokens,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            rewards=view.rewards[a:b],
            advantages=advantages,
            sampling=view.sampling[a:b],
            table=self._table,
            first=ids[0] if ids else 0,
            left=b - a,
        )
        self._keep(ids, block)

    def _keep(self, ids: list[int], block: Block) -> None:
        if not ids:
            return
        tok = block.tok  # read directly: `len(block)` and `token_count` are Python calls a group
        assert ids[-1] - ids[0] == len(ids) - 1 == len(tok) - 2, "a stored group's ids are consecutive"
        self._at.update(dict.fromkeys(ids, block))
        self._blocks[block.first] = block
        self.tokens += tok[-1]
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

    def take(self, ids: list[int], array: Array | None = None) -> list[Segment | int]:
        """Remove these ids; return, in their order, runs of kept consecutive sequences of one block
        as (block, k0, k1), and each id not kept as itself. Runs of consecutive ids are taken a block
        at a time (a batch takes whole groups, or their consecutive parts). `array`: the same ids as
        an int64 array, when the caller has one."""
        out: list[Segment | int] = []
        n = len(ids)
        if not n:
            return out
        cuts = (
            np.flatnonzero(np.diff(np.asarray(ids if array is None else array, np.int64)) != 1) + 1
        ).tolist()
        at = self._at
        for s, e in zip([0, *cuts], [*cuts, n], strict=True):
            i = s
            while i < e:
                first = ids[i]
                block = at.get(first)
                if block is None:
                    out.append(first)
                    i += 1
                    continue
                k0 = first - block.first
                k1 = min(len(block), k0 + e - i)
                got = list(map(at.pop, range(first, first + k1 - k0), repeat(None)))
                kept = got.count(block)
                if kept == len(got):
                    _add(out, block, k0, k1)
                else:  # some of them were taken before (a replayed id next to fresh ones)
                    for j, g in enumerate(got):
                        if g is block:
                            _add(out, block, k0 + j, k0 + j + 1)
                        else:
                            out.append(first + j)
                block.left -= kept
                if not block.left:
                    self._blocks.pop(block.first, None)
                    self.tokens -= block.token_count
                i += k1 - k0
        return out


def _add(out: list[Segment | int], block: Block, k0: int, k1: int) -> None:
    """Append sequences k0..k1-1 of a block, joined to the run before when it ends at k0."""
    last = out[-1] if out else None
    if isinstance(last, tuple) and last[0] is block and last[2] == k0:
        out[-1] = (block, last[1], k1)
    else:
        out.append((block, k0, k1))


def _stored(sp: SamplingParams) -> SamplingParams:
    """The settings as state.db gives them back (floats, an int): what a batch read back carries."""
    return sampling(float(sp.temperature), float(sp.top_p), int(sp.top_k))


@lru_cache(maxsize=64)
def sampling(temperature: float, top_p: float, top_k: int) -> SamplingParams:
    """The (frozen, so shareable) settings of stored samples: a batch has one or a few distinct ones."""
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)

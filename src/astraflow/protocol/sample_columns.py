"""A batch's samples as columns: what a BatchReply carries (docs/protocol.md, "Batches as columns").

The controller builds them from blocks of stored sequences (`Block`: a stored group's joined arrays,
or rows read back from state.db) without a Python object per sequence: a run of a group's
consecutive sequences is one chunk, a view of each of the block's arrays, which the encoder copies
once into the message. The trainer checks the layout (`problem`) and cuts the chunks into the
TrainSamples its step consumes (`cut`), each array a slice of its chunk's bytes, so a sample holds
exactly the bytes it held when it travelled on its own.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from itertools import accumulate, chain, repeat
from typing import Any

import msgspec
import numpy as np

from astraflow.protocol import packed
from astraflow.protocol.messages import SampleColumns, SamplingParams, TrainSample

Array = np.ndarray[Any, Any]
INT64 = "<i8"
"""numpy dtype of the trajectory ids."""
FLOAT64 = "<f8"
"""numpy dtype of rewards and advantages."""


@dataclass(slots=True)
class Block:
    """Consecutive stored sequences with their arrays joined (one bytes object per per-token field):
    sequence k's tokens are `tokens[4 * tok[k] : 4 * tok[k + 1]]`."""

    tok: list[int]
    """One per sequence and one after the last: where each sequence's tokens start (tok[0] == 0)."""
    lengths: Array
    """int32, one per sequence: its tokens."""
    tokens: bytes
    loss_mask: bytes
    logprobs: bytes
    versions: bytes
    rewards: Array
    """float64, one per sequence."""
    advantages: list[float]
    """One per sequence (a list: joined into one array per batch, not one per group)."""
    sampling: Array
    """int, one per sequence: an index into `table`."""
    table: list[SamplingParams]
    """The distinct sampling settings the sequences index."""
    first: int = 0
    """The trajectory id of sequence 0 (the ids of a stored group are consecutive)."""
    left: int = field(default=0)
    """Sequences of the block still wanted (FreshSamples drops the block at 0)."""

    def __len__(self) -> int:
        return len(self.tok) - 1

    @property
    def token_count(self) -> int:
        """Tokens in the block."""
        return self.tok[-1]

    @classmethod
    def of_samples(cls, samples: collections.abc.Sequence[TrainSample], first: int = 0) -> Block:
        """A block of TrainSamples, in order."""
        return cls.of_arrays(
            [(s.tokens, s.loss_mask, s.logprobs, s.versions) for s in samples],
            [s.reward for s in samples],
            [s.advantage for s in samples],
            [s.sampling for s in samples],
            first,
        )

    @classmethod
    def of_arrays(
        cls,
        arrays: list[tuple[bytes, bytes, bytes, bytes]],
        rewards: list[float],
        advantages: list[float],
        samplings: list[SamplingParams],
        first: int = 0,
    ) -> Block:
        """A block of sequences given one by one: (tokens, loss_mask, logprobs, versions) each."""
        lengths = [len(a[1]) for a in arrays]
        table: dict[SamplingParams, int] = {}
        return cls(
            tok=[0, *accumulate(lengths)],
            lengths=np.array(lengths, packed.INT32),
            tokens=b"".join([a[0] for a in arrays]),
            loss_mask=b"".join([a[1] for a in arrays]),
            logprobs=b"".join([a[2] for a in arrays]),
            versions=b"".join([a[3] for a in arrays]),
            rewards=np.array(rewards, np.float64),
            advantages=list(advantages),
            sampling=np.array([table.setdefault(sp, len(table)) for sp in samplings], np.int64),
            table=list(table),
            first=first,
            left=len(arrays),
        )

    def runs(self, k0: int, k1: int) -> list[tuple[SamplingParams, int]]:
        """(settings, how many) of each run of equal settings among sequences k0..k1-1."""
        if len(self.table) == 1:
            return [(self.table[0], k1 - k0)]
        index = self.sampling[k0:k1]
        starts = np.flatnonzero(np.concatenate(([True], index[1:] != index[:-1])))
        counts = np.diff(np.append(starts, len(index))).tolist()
        return [(self.table[i], n) for i, n in zip(index[starts].tolist(), counts, strict=True)]


Segment = tuple[Block, int, int]
"""Sequences k0..k1-1 of a block."""
Ids = collections.abc.Sequence[int] | Array
"""Integers, one per sample: a list or a numpy array."""


def join(segments: list[Segment], ids: Ids, replay: Ids) -> SampleColumns:
    """The columns of these blocks' sequences, in order, as samples with these ids and replay flags
    (lists, or arrays where the caller has them: no conversion a sequence). Each segment is one chunk,
    its arrays views of the block's: the encoder copies them once, into the message."""
    if not segments:
        return SampleColumns()
    tok = [(b, b.tok[k0], b.tok[k1]) for b, k0, k1 in segments]
    samplings: list[SamplingParams] = []
    counts: list[int] = []
    for b, k0, k1 in segments:
        for sp, n in b.runs(k0, k1):
            if samplings and (sp is samplings[-1] or sp == samplings[-1]):
                counts[-1] += n
            else:
                samplings.append(sp)
                counts.append(n)
    # memoryviews encode as bytes (msgspec); the views keep nothing but the blocks' bytes alive
    views: Any = [
        (memoryview(b.tokens), memoryview(b.loss_mask), memoryview(b.logprobs), memoryview(b.versions))
        for b, _t0, _t1 in tok
    ]
    return SampleColumns(
        traj_ids=np.array(ids, INT64).tobytes(),
        lengths=np.concatenate([b.lengths[k0:k1] for b, k0, k1 in segments]).astype(packed.INT32).tobytes(),
        chunks=np.array([k1 - k0 for _b, k0, k1 in segments], packed.INT32).tobytes(),
        tokens=[v[0][4 * t0 : 4 * t1] for v, (_b, t0, t1) in zip(views, tok, strict=True)],
        loss_mask=[v[1][t0:t1] for v, (_b, t0, t1) in zip(views, tok, strict=True)],
        logprobs=[v[2][4 * t0 : 4 * t1] for v, (_b, t0, t1) in zip(views, tok, strict=True)],
        versions=[v[3][4 * t0 : 4 * t1] for v, (_b, t0, t1) in zip(views, tok, strict=True)],
        rewards=np.concatenate([b.rewards[k0:k1] for b, k0, k1 in segments]).astype(FLOAT64).tobytes(),
        advantages=np.array(
            list(chain.from_iterable(b.advantages[k0:k1] for b, k0, k1 in segments)), FLOAT64
        ).tobytes(),
        replay=np.array(replay, np.uint8).tobytes(),
        sampling_runs=np.array(counts, packed.INT32).tobytes(),
        samplings=samplings,
    )


def pack(samples: collections.abc.Sequence[TrainSample]) -> SampleColumns:
    """The columns of these samples (one by one: for samples built in process)."""
    if not samples:
        return SampleColumns()
    block = Block.of_samples(samples)
    return join([(block, 0, len(block))], [s.traj_id for s in samples], [s.replay for s in samples])


def problem(cols: SampleColumns) -> str:
    """Why these columns are not a batch's samples ('' when their layout adds up)."""
    n, rest = divmod(len(cols.traj_ids), 8)
    if rest:
        return f"traj_ids is {len(cols.traj_ids)} bytes, not a whole number of int64"
    per_sample = {"lengths": 4, "rewards": 8, "advantages": 8, "replay": 1}
    for name, size in per_sample.items():
        have = len(getattr(cols, name))
        if have != size * n:
            return f"{name} is {have} bytes for {n} samples ({size} each)"
    lengths = np.frombuffer(cols.lengths, packed.INT32)
    if n and int(lengths.min()) < 0:
        return "a sample's length is negative"
    why = _chunks_problem(cols, n, lengths)
    if why:
        return why
    if n and int(np.frombuffer(cols.replay, np.uint8).max()) > 1:
        return "replay holds a value other than 0 or 1"
    if len(cols.sampling_runs) != 4 * len(cols.samplings):
        return f"sampling_runs is {len(cols.sampling_runs)} bytes for {len(cols.samplings)} samplings"
    runs = np.frombuffer(cols.sampling_runs, packed.INT32)
    if len(runs) and int(runs.min()) < 0:
        return "a sampling run is negative"
    if int(runs.sum(dtype=np.int64)) != n:
        return f"sampling_runs add up to {int(runs.sum(dtype=np.int64))}, not the {n} samples"
    for sp in cols.samplings:
        why = sp.problem()
        if why:
            return f"sampling settings: {why}"
    return ""


def _chunks_problem(cols: SampleColumns, n: int, lengths: Array) -> str:
    """Why the chunks of per-token arrays do not hold the samples' tokens ('' when they do)."""
    if len(cols.chunks) % 4:
        return f"chunks is {len(cols.chunks)} bytes, not a whole number of int32"
    counts = np.frombuffer(cols.chunks, packed.INT32)
    if len(counts) and int(counts.min()) < 0:
        return "a chunk's sample count is negative"
    if int(counts.sum(dtype=np.int64)) != n:
        return f"chunks add up to {int(counts.sum(dtype=np.int64))} samples, not the {n} there are"
    fields = (cols.tokens, cols.loss_mask, cols.logprobs, cols.versions)
    if any(len(f) != len(counts) for f in fields):
        return (
            f"tokens/loss_mask/logprobs/versions hold {'/'.join(str(len(f)) for f in fields)} chunks, "
            f"not the {len(counts)} of `chunks`"
        )
    tok = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=tok[1:])
    bounds = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=bounds[1:])
    want = tok[bounds[1:]] - tok[bounds[:-1]]
    for name, f, size in zip(
        ("tokens", "loss_mask", "logprobs", "versions"), fields, (4, 1, 4, 4), strict=True
    ):
        have = np.array([len(x) for x in f], np.int64)
        bad = np.flatnonzero(have != size * want)
        if len(bad):
            j = int(bad[0])
            return (
                f"{name} chunk {j} is {int(have[j])} bytes for {int(want[j])} tokens (the sum of its lengths)"
            )
    return ""


def cut(cols: SampleColumns) -> list[TrainSample]:
    """The TrainSamples of these columns, in order: each array a slice of its chunk's bytes
    (ValueError naming the fault when the layout does not add up)."""
    why = problem(cols)
    if why:
        raise ValueError(f"batch columns: {why}")
    n = cols.count
    if not n:
        return []
    counts = np.frombuffer(cols.chunks, packed.INT32)
    tok = np.zeros(n + 1, np.int64)
    np.cumsum(np.frombuffer(cols.lengths, packed.INT32), out=tok[1:])
    chunk = np.repeat(np.arange(len(counts)), counts)
    first = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    base = tok[first[chunk]]  # each sample's chunk's first token
    starts = (tok[:-1] - base).tolist()
    ends = (tok[1:] - base).tolist()
    # decoded chunks are bytes; the controller's own (in process) may be views of its blocks
    tokens, mask, logprobs, versions = (
        [x if type(x) is bytes else bytes(x) for x in f]
        for f in (cols.tokens, cols.loss_mask, cols.logprobs, cols.versions)
    )
    runs = np.frombuffer(cols.sampling_runs, packed.INT32).tolist()
    samplings = [sp for sp, r in zip(cols.samplings, runs, strict=True) for sp in repeat(sp, r)]
    # a template's copy with every field replaced: the fields are packed bytes already
    template = TrainSample(
        traj_id=0,
        tokens=b"",
        loss_mask=b"",
        logprobs=b"",
        versions=b"",
        reward=0.0,
        advantage=0.0,
        sampling=samplings[0],
    )
    make = msgspec.structs.replace
    return [
        make(
            template,
            traj_id=i,
            tokens=tokens[j][4 * t0 : 4 * t1],
            loss_mask=mask[j][t0:t1],
            logprobs=logprobs[j][4 * t0 : 4 * t1],
            versions=versions[j][4 * t0 : 4 * t1],
            reward=reward,
            advantage=adv,
            sampling=sp,
            replay=replay,
        )
        for i, j, t0, t1, reward, adv, sp, replay in zip(
            np.frombuffer(cols.traj_ids, INT64).tolist(),
            chunk.tolist(),
            starts,
            ends,
            np.frombuffer(cols.rewards, FLOAT64).tolist(),
            np.frombuffer(cols.advantages, FLOAT64).tolist(),
            samplings,
            map(bool, cols.replay),
            strict=True,
        )
    ]


def part(cols: SampleColumns, a: int, b: int) -> SampleColumns:
    """Samples a..b-1 of these columns (well-formed ones: the controller's own)."""
    n = cols.count
    if a == 0 and b >= n:
        return cols
    lengths = np.frombuffer(cols.lengths, packed.INT32)
    tok = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=tok[1:])
    counts = np.frombuffer(cols.chunks, packed.INT32).astype(np.int64)
    c_end = np.cumsum(counts)
    c_start = c_end - counts
    fields: tuple[list[Any], list[Any], list[Any], list[Any]] = ([], [], [], [])
    kept_counts = []
    for j in np.flatnonzero((c_end > a) & (c_start < b)).tolist():
        s0, s1 = max(a, int(c_start[j])), min(b, int(c_end[j]))
        t_base = int(tok[c_start[j]])
        t0, t1 = int(tok[s0]) - t_base, int(tok[s1]) - t_base
        for out, f, size in zip(
            fields, (cols.tokens, cols.loss_mask, cols.logprobs, cols.versions), (4, 1, 4, 4), strict=True
        ):
            whole = s0 == c_start[j] and s1 == c_end[j]
            out.append(f[j] if whole else memoryview(f[j])[size * t0 : size * t1])
        kept_counts.append(s1 - s0)
    runs = np.frombuffer(cols.sampling_runs, packed.INT32).astype(np.int64)
    ends = np.cumsum(runs)
    starts = ends - runs
    sel = np.flatnonzero((ends > a) & (starts < b))
    kept = np.minimum(ends[sel], b) - np.maximum(starts[sel], a)
    return SampleColumns(
        traj_ids=cols.traj_ids[8 * a : 8 * b],
        lengths=cols.lengths[4 * a : 4 * b],
        chunks=np.array(kept_counts, packed.INT32).tobytes(),
        tokens=fields[0],
        loss_mask=fields[1],
        logprobs=fields[2],
        versions=fields[3],
        rewards=cols.rewards[8 * a : 8 * b],
        advantages=cols.advantages[8 * a : 8 * b],
        replay=cols.replay[a:b],
        sampling_runs=kept.astype(packed.INT32).tobytes(),
        samplings=[cols.samplings[i] for i in sel.tolist()],
    )


def with_advantages(cols: SampleColumns, advantages: list[float]) -> SampleColumns:
    """The same columns with these advantages (one per sample)."""
    return msgspec.structs.replace(cols, advantages=np.array(advantages, FLOAT64).tobytes())


def advantage_list(cols: SampleColumns) -> list[float]:
    """The advantages as Python floats."""
    return list(np.frombuffer(cols.advantages, FLOAT64).tolist())


def replayed(cols: SampleColumns) -> int:
    """Samples flagged as replay."""
    return int(np.frombuffer(cols.replay, np.uint8).sum(dtype=np.int64))


def id_list(cols: SampleColumns) -> list[int]:
    """The trajectory ids, in order."""
    return list(np.frombuffer(cols.traj_ids, INT64).tolist())


def length_list(cols: SampleColumns) -> list[int]:
    """Tokens of each sample, in order."""
    return list(np.frombuffer(cols.lengths, packed.INT32).tolist())


def token_count(cols: SampleColumns) -> int:
    """Tokens of all the samples."""
    return int(np.frombuffer(cols.lengths, packed.INT32).sum(dtype=np.int64))

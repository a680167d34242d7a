"""A TaskResults' sequences as columns: one bytes object per field for all the sequences of a message.

A RaaS builds them from its finished results (`pack`): the per-token arrays of every sequence
joined (their token counts in `lengths`), rewards as float64, and policy, role, group key and
sampling settings as int32 indices into small tables. The controller reads a message through
`ResultColumns`: the layout is checked once (`problem`), each result's sequences are a range of
indices, and a result is turned back into an `Outcome` of `PackedSequence`s only where a slow path
needs one (a result the per-token checks did not clear, an evaluation task, a filter's view).
docs/protocol.md, "Columns per message".
"""

from __future__ import annotations

import collections.abc
from functools import cached_property
from itertools import accumulate
from typing import Any

import numpy as np

from astraflow.protocol import packed
from astraflow.protocol.messages import (
    Outcome,
    PackedEpisode,
    PackedSequence,
    ResultHead,
    SamplingParams,
    SequenceColumns,
    TaskResults,
)

FLOAT64 = "<f8"
"""numpy dtype of the rewards column."""


def _layout(s: PackedSequence) -> str:
    """Why one sequence's arrays cannot be a slice of the columns ('' when they can)."""
    why = packed.layout_problem(s.tokens, s.loss_mask, s.logprobs, s.versions)
    if why:
        return why
    n = len(s.loss_mask)
    if not (len(s.tokens) == len(s.logprobs) == len(s.versions) == 4 * n):
        sizes = f"{len(s.tokens) // 4}/{n}/{len(s.logprobs) // 4}/{len(s.versions) // 4}"
        return f"tokens/loss_mask/logprobs/versions lengths differ ({sizes})"
    return ""


def _columnable(o: Outcome) -> Outcome:
    """The outcome itself, or (a sequence whose arrays disagree in length cannot be a slice of the
    columns) the error naming that sequence, which the controller charges as a failed attempt."""
    for i, ep in enumerate(o.episodes):
        for j, s in enumerate(ep.sequences):
            why = _layout(s)
            if why:
                return Outcome(
                    task_id=o.task_id, epoch=o.epoch, error=f"invalid result: episode {i} sequence {j}: {why}"
                )
    return o


def columnable(o: Outcome) -> bool:
    """Whether every sequence of the result can be a slice of the columns."""
    return _columnable(o) is o


def pack(outcomes: collections.abc.Sequence[Outcome], rid: int = 0, *, checked: bool = False) -> TaskResults:
    """One TaskResults holding these results, their sequences in columns (an errored result carries none);
    `checked`: every result is known to be `columnable` already."""
    heads: list[ResultHead] = []
    seqs: list[PackedSequence] = []
    for o in outcomes if checked else map(_columnable, outcomes):
        if o.error:
            heads.append(ResultHead(task_id=o.task_id, epoch=o.epoch, error=o.error))
            continue
        infos = {e: dict(ep.info) for e, ep in enumerate(o.episodes) if ep.info}
        heads.append(
            ResultHead(
                task_id=o.task_id,
                epoch=o.epoch,
                episodes=[len(ep.sequences) for ep in o.episodes],
                infos=infos,
            )
        )
        for ep in o.episodes:
            seqs.extend(ep.sequences)
    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    samplings: dict[SamplingParams, int] = {}
    cols = SequenceColumns(
        lengths=_ints([len(s.loss_mask) for s in seqs]),
        tokens=b"".join([s.tokens for s in seqs]),
        loss_mask=b"".join([s.loss_mask for s in seqs]),
        logprobs=b"".join([s.logprobs for s in seqs]),
        versions=b"".join([s.versions for s in seqs]),
        rewards=np.array([s.reward for s in seqs], FLOAT64).tobytes(),
        policy=_ints([names.setdefault(s.policy, len(names)) for s in seqs]),
        role=_ints([names.setdefault(s.role, len(names)) for s in seqs]),
        group_key=_ints([keys.setdefault(s.group_key, len(keys)) for s in seqs]),
        sampling=_ints([samplings.setdefault(s.sampling, len(samplings)) for s in seqs]),
        names=list(names),
        keys=list(keys),
        samplings=list(samplings),
        turns={k: list(s.turns) for k, s in enumerate(seqs) if s.turns is not None},
    )
    return TaskResults(rid=rid, results=heads, columns=cols)


def join(views: collections.abc.Sequence[ResultColumns], rid: int = 0) -> TaskResults:
    """One TaskResults holding the results of these messages (each read without a `problem`), in
    order, built from their columns: the per-token and per-sequence bytes joined, the index columns
    mapped into the union of their tables, the turns moved by each message's first sequence. No
    sequence becomes a Python object (`pack` of their outcomes gives the same results, its tables
    perhaps in another order)."""
    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    samplings: dict[SamplingParams, int] = {}
    heads: list[ResultHead] = []
    index: dict[str, list[np.ndarray[Any, Any]]] = {"policy": [], "role": [], "group_key": [], "sampling": []}
    turns: dict[int, list[tuple[int, int, bool]]] = {}
    first = 0
    for v in views:
        c = v.cols
        heads += v.heads
        name_at = np.array([names.setdefault(x, len(names)) for x in c.names], np.int32)
        key_at = np.array([keys.setdefault(x, len(keys)) for x in c.keys], np.int32)
        sampling_at = np.array([samplings.setdefault(x, len(samplings)) for x in c.samplings], np.int32)
        if v.count:
            index["policy"].append(name_at[v.policy])
            index["role"].append(name_at[v.role])
            index["group_key"].append(key_at[v.key])
            index["sampling"].append(sampling_at[v.sampling])
        turns.update({first + k: t for k, t in c.turns.items()})
        first += v.count
    cols = SequenceColumns(
        **{f: b"".join([getattr(v.cols, f) for v in views]) for f in _JOINED},
        **{f: np.concatenate(a).astype(packed.INT32).tobytes() if a else b"" for f, a in index.items()},
        names=list(names),
        keys=list(keys),
        samplings=list(samplings),
        turns=turns,
    )
    return TaskResults(rid=rid, results=heads, columns=cols)


_JOINED = ("lengths", "tokens", "loss_mask", "logprobs", "versions", "rewards")
"""The columns a join concatenates as they are."""


def _ints(values: list[int]) -> bytes:
    return np.array(values, packed.INT32).tobytes()


def _indices(name: str, data: bytes, n: int, table: int) -> tuple[np.ndarray[Any, Any], str]:
    if len(data) != 4 * n:
        return np.zeros(0, np.int32), f"{name} is {len(data)} bytes for {n} sequences (int32 each)"
    a = np.frombuffer(data, packed.INT32)
    # read as unsigned, a negative index is above every table: one pass finds both
    if n and int(np.frombuffer(data, "<u4").max()) >= table:
        return a, f"{name} holds an index outside its table of {table}"
    return a, ""


class ResultColumns:
    """A decoded TaskResults read through its columns: `problem` says why its layout is unusable
    ('' when it is fine; then nothing else may be used)."""

    def __init__(self, msg: TaskResults) -> None:
        self.msg = msg
        self.heads = msg.results
        self.cols = msg.columns
        self.starts = list(accumulate((sum(h.episodes) for h in self.heads), initial=0))
        """Index of each result's first sequence (and the total after the last)."""
        self.count = self.starts[-1]
        empty = np.zeros(0, np.int32)
        self.lengths = self.policy = self.role = self.key = self.sampling = empty
        self.rewards = np.zeros(0, np.float64)
        self.tok = np.zeros(1, np.int64)
        """Index of each sequence's first token (and the total after the last)."""
        self._uniform: dict[str, list[bool]] = {}
        self._joined: dict[tuple[int, int], tuple[bytes, bytes, bytes, bytes]] = {}
        why = self._read()
        self.problem = f"TaskResults columns: {why}" if why else ""

    def _read(self) -> str:
        """Read the columns into arrays; why their layout is unusable ('' when it is fine)."""
        c, n = self.cols, self.count
        if any(min(h.episodes, default=0) < 0 for h in self.heads):
            return "an episode's sequence count is negative"
        if len(c.lengths) != 4 * n or len(c.rewards) != 8 * n:
            return f"lengths ({len(c.lengths)} bytes) or rewards ({len(c.rewards)} bytes) do not fit {n} sequences"
        lengths = np.frombuffer(c.lengths, packed.INT32)
        if n and int(lengths.min()) < 0:
            return "a sequence's length is negative"
        total = int(lengths.sum(dtype=np.int64))
        if not len(c.tokens) == len(c.logprobs) == len(c.versions) == 4 * total == 4 * len(c.loss_mask):
            return (
                f"tokens/loss_mask/logprobs/versions are {len(c.tokens)}/{len(c.loss_mask)}/"
                f"{len(c.logprobs)}/{len(c.versions)} bytes for {total} tokens"
            )
        found = []
        for name, data, table in (
            ("policy", c.policy, len(c.names)),
            ("role", c.role, len(c.names)),
            ("group_key", c.group_key, len(c.keys)),
            ("sampling", c.sampling, len(c.samplings)),
        ):
            a, why = _indices(name, data, n, table)
            if why:
                return why
            found.append(a)
        if any(not 0 <= k < n for k in c.turns):
            return "turns names a sequence the message does not have"
        if any(not 0 <= e < len(h.episodes) for h in self.heads for e in h.infos):
            return "infos names an episode its result does not have"
        self.lengths = lengths
        self.policy, self.role, self.key, self.sampling = found
        self.rewards = np.frombuffer(c.rewards, FLOAT64)
        self.tok = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=self.tok[1:])
        return ""

    @cached_property
    def rewards_finite(self) -> bool:
        """Whether every reward of the message is finite (one pass; a result of a message where one
        is not checks its own)."""
        return bool(np.isfinite(self.rewards).all())

    @cached_property
    def reward_list(self) -> list[float]:
        """The rewards column as Python floats (sliced per result)."""
        return list(self.rewards.tolist())

    def uniform(self, name: str) -> list[bool]:
        """Per result: whether its sequences hold one value in column `name` ("policy", "role" or
        "key"), found for every result of the message in one pass and kept."""
        got = self._uniform.get(name)
        if got is None:
            col = getattr(self, name)
            starts = np.asarray(self.starts, np.int64)
            # k is a break when sequence k differs from k - 1; result [a, b) is uniform when no break
            # falls in a < k < b
            breaks = np.flatnonzero(col[1:] != col[:-1]) + 1
            before = np.searchsorted(breaks, starts[:-1], side="right")
            inside = np.searchsorted(breaks, starts[1:], side="left")
            got = self._uniform[name] = (inside <= before).tolist()
        return got

    @cached_property
    def group_policy(self) -> list[str | None]:
        """Per result: the name of its sequences' one policy when it has sequences and they all hold
        one policy and one group key (None otherwise), found for every result at once."""
        names, policy, starts = self.cols.names, self.policy, self.starts
        one = [p and k for p, k in zip(self.uniform("policy"), self.uniform("key"), strict=True)]
        return [
            names[int(policy[a])] if ok and b > a else None
            for ok, a, b in zip(one, starts, starts[1:], strict=False)
        ]

    def span(self, i: int) -> tuple[int, int]:
        """The sequence indices [a, b) of result i."""
        return self.starts[i], self.starts[i + 1]

    def joined(self, a: int, b: int) -> tuple[bytes, bytes, bytes, bytes]:
        """The packed (tokens, loss_mask, logprobs, versions) of sequences a..b-1, joined: cut once
        and kept (a stored group's row and the buffer's block share the same bytes)."""
        got = self._joined.get((a, b))
        if got is None:
            c = self.cols
            t0, t1 = int(self.tok[a]), int(self.tok[b])
            got = self._joined[(a, b)] = (
                c.tokens[4 * t0 : 4 * t1],
                c.loss_mask[t0:t1],
                c.logprobs[4 * t0 : 4 * t1],
                c.versions[4 * t0 : 4 * t1],
            )
        return got

    def arrays(self, a: int, b: int) -> list[tuple[bytes, bytes, bytes, bytes]]:
        """Each sequence's packed arrays, for sequences a..b-1."""
        c = self.cols
        tok = self.tok[a : b + 1].tolist()
        out = []
        for t0, t1 in zip(tok, tok[1:], strict=False):
            q0, q1 = 4 * t0, 4 * t1
            out.append((c.tokens[q0:q1], c.loss_mask[t0:t1], c.logprobs[q0:q1], c.versions[q0:q1]))
        return out

    def sequence(self, k: int) -> PackedSequence:
        """Sequence k as a PackedSequence (slow path)."""
        c = self.cols
        tokens, mask, logprobs, versions = self.arrays(k, k + 1)[0]
        return PackedSequence(
            policy=c.names[int(self.policy[k])],
            tokens=tokens,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            sampling=c.samplings[int(self.sampling[k])],
            reward=float(self.rewards[k]),
            role=c.names[int(self.role[k])],
            group_key=c.keys[int(self.key[k])],
            turns=c.turns.get(k),
        )

    def outcome(self, i: int) -> Outcome:
        """Result i as the Outcome it stands for (slow path: a Python object per sequence)."""
        h = self.heads[i]
        k = self.starts[i]
        episodes = []
        for e, n in enumerate(h.episodes):
            seqs = [self.sequence(j) for j in range(k, k + n)]
            episodes.append(PackedEpisode(sequences=seqs, info=h.infos.get(e, {})))
            k += n
        return Outcome(task_id=h.task_id, epoch=h.epoch, episodes=episodes, error=h.error)

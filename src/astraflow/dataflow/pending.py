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

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

import numpy as np

from astraflow.dataflow.buffered import Part, join_parts
from astraflow.protocol import packed
from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import PackedSequence
from astraflow.state import token_groups, trajectories
from astraflow.state.store import Store

_NONE = np.iinfo(np.int32).max


@dataclass
class Group:
    """One group's sequences (one policy) waiting to be written, with the ids they will get: a list
    of sequences, or (`cols`) the sequences a..b-1 of a message's columns."""

    first_id: int
    task_id: int
    prompt_key: str
    seqs: list[PackedSequence]
    advantages: list[float]
    status: str
    cols: tuple[ResultColumns, int, int] | None = None

    @property
    def size(self) -> int:
        """Sequences in the group."""
        return len(self.seqs) if self.cols is None else self.cols[2] - self.cols[1]


@dataclass
class Pending:
    """Groups added since the block began, and the id the next sequence gets."""

    next_id: int
    groups: list[Group] = field(default_factory=list)

    def add(
        self, task_id: int, prompt_key: str, seqs: list[PackedSequence], advantages: list[float], status: str
    ) -> list[int]:
        """Queue a group; the ids its sequences will have."""
        return self._add(Group(self.next_id, task_id, prompt_key, seqs, advantages, status))

    def add_columns(
        self,
        task_id: int,
        prompt_key: str,
        cols: tuple[ResultColumns, int, int],
        advantages: list[float],
        status: str,
    ) -> list[int]:
        """Queue a group that is the sequences a..b-1 of a message's columns (view, a, b)."""
        return self._add(Group(self.next_id, task_id, prompt_key, [], advantages, status, cols))

    def _add(self, g: Group) -> list[int]:
        self.groups.append(g)
        self.next_id += g.size
        return list(range(g.first_id, self.next_id))

    def write(self, store: Store) -> dict[str, Part]:
        """Write every queued group: two statements in all (inside the caller's transaction); the
        buffered ones as the buffer keeps them (dataflow/buffered.py), one part per policy."""
        if not self.groups:
            return {}
        oldest = iter(min_versions([s for g in self.groups for s in g.seqs]))
        facts: dict[int, _Facts] = {}
        # consecutive groups of one layout share a run: the usual write is one run
        runs: list[tuple[trajectories.Layout, list[tuple[Any, ...]]]] = []
        tokens: list[tuple[Any, ...]] = []
        kept = _Kept()
        for g in self.groups:
            if g.cols is None:
                rows = _run(runs, trajectories.FULL)
                done = len(rows)
                rows += _seq_rows(g, oldest)
                tokens.append(
                    token_groups.group_row(
                        g.first_id, [(s.tokens, s.loss_mask, s.logprobs, s.versions) for s in g.seqs]
                    )
                )
                if g.status == "buffered":
                    kept.rows(rows[done:])
                continue
            view, a, b = g.cols
            f = facts.get(id(view)) or facts.setdefault(id(view), _Facts.of(view))
            layout = f.layouts[g.status == "buffered"]
            _run(runs, layout).extend(_column_rows(g, view, f, a, b, layout))
            # the lengths column's bytes are the group's int32 token counts as they came
            tokens.append(
                token_groups.joined_row(
                    g.first_id, b - a, view.cols.lengths[4 * a : 4 * b], view.joined(a, b)
                )
            )
            if g.status == "buffered":
                kept.columns(g, view, f)
        trajectories.insert_runs(store, self.groups[0].first_id, runs, tokens)
        return kept.parts()


def _run(
    runs: list[tuple[trajectories.Layout, list[tuple[Any, ...]]]], layout: trajectories.Layout
) -> list[tuple[Any, ...]]:
    """The rows of the newest run when it has this layout, else of a new run of it."""
    if not runs or runs[-1][0] != layout:
        runs.append((layout, []))
    return runs[-1][1]


class _Kept:
    """The buffered trajectories of one write, gathered per policy as the buffer keeps them: a
    message's column groups as (first id, task id, a, b, advantages) each, turned into arrays by a
    few numpy passes at the end; groups of sequences from their rows."""

    def __init__(self) -> None:
        self._views: dict[tuple[str, int], tuple[ResultColumns, _Facts, list[tuple[Any, ...]]]] = {}
        """(policy, message) -> its columns, their facts, and its buffered groups."""
        self._rows: dict[str, list[list[Any]]] = {}

    def columns(self, g: Group, view: ResultColumns, f: _Facts) -> None:
        """Keep the column group g (buffered)."""
        assert g.cols is not None
        a, b = g.cols[1], g.cols[2]
        pol = view.cols.names[int(view.policy[a])]
        got = self._views.get((pol, id(view)))
        if got is None:
            got = self._views[(pol, id(view))] = (view, f, [])
        got[2].append((g.first_id, g.task_id, a, b, g.advantages))

    def rows(self, rows: list[tuple[Any, ...]]) -> None:
        """Keep the buffered trajectory rows of a group of sequences (trajectories.insert_groups' layout)."""
        for r in rows:
            mine = self._rows.setdefault(r[1], [[] for _ in range(7)])
            # (traj_id, task_id, min_version, arrival, reward, advantage, length): arrival is the id
            for column, value in zip(mine, (r[7], r[0], r[6], r[7], r[3], r[4], r[5]), strict=True):
                column.append(value)

    def parts(self) -> dict[str, Part]:
        """Policy -> its kept trajectories as BufferItem's fields, one array each."""
        pieces: dict[str, list[Part]] = {}
        for (pol, _), (view, f, groups) in self._views.items():
            firsts, tasks, starts, ends, advantages = zip(*groups, strict=True)
            begin = np.asarray(starts, np.int64)
            sizes = np.asarray(ends, np.int64) - begin
            total = int(sizes.sum())
            # sequence k of the joined groups is the offset-th of its group: a run of consecutive
            # indices per group, both into the message's columns and among the ids
            offset = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
            idx = np.repeat(begin, sizes) + offset
            ids_a = np.repeat(np.asarray(firsts, np.int64), sizes) + offset
            pieces.setdefault(pol, []).append(
                (
                    ids_a,
                    np.repeat(np.asarray(tasks, np.int64), sizes),
                    f.oldest_a[idx],
                    ids_a,
                    view.rewards[idx],
                    np.fromiter(chain.from_iterable(advantages), np.float64, total),
                    f.masked_a[idx],
                )
            )
        for pol, lists in self._rows.items():
            pieces.setdefault(pol, []).append(tuple(lists))
        return {pol: join_parts(parts) for pol, parts in pieces.items()}


def _seq_rows(g: Group, oldest: Iterator[int]) -> list[tuple[Any, ...]]:
    """The trajectory rows of a group of sequences (`oldest`: their min versions, in order)."""
    rows = []
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
    return rows


@dataclass
class _Facts:
    """What the rows of a message's column groups need per sequence, found once per message: a
    group's rows are then slices of these lists zipped together."""

    masked: list[int]
    """Tokens with a nonzero mask."""
    oldest: list[int]
    """min_versions of each sequence."""
    masked_a: np.ndarray[Any, Any]
    """`masked` as int64."""
    oldest_a: np.ndarray[Any, Any]
    """`oldest` as int64."""
    optional: dict[str, list[Any]]
    """Optional column (trajectories.OPTIONAL, status aside) -> each sequence's value, for the
    columns some sequence of the message holds other than the default (the others are not built)."""
    layouts: tuple[trajectories.Layout, trajectories.Layout]
    """The row layout of a group of this message that is not buffered, and of one that is: the
    optional columns left out are those whose default every sequence of the message holds (status
    is a group's own)."""

    @classmethod
    def of(cls, view: ResultColumns) -> _Facts:
        """Every list for every sequence of the message, in one numpy pass each."""
        c = view.cols
        mask = np.frombuffer(c.loss_mask, np.uint8) != 0
        versions = np.frombuffer(c.versions, packed.INT32)
        starts, lengths = view.tok[:-1], view.lengths
        if not len(lengths):
            none = np.zeros(0, np.int64)
            return cls([], [], none, none, {}, (trajectories.FULL, trajectories.FULL))
        # a sentinel after the last token: reduceat needs every start inside the array; a sequence
        # of no tokens reads its neighbour's first, so it is zeroed
        masked = np.add.reduceat(np.append(mask, False).astype(np.int64), starts)
        masked[lengths == 0] = 0
        oldest = _oldest(versions, mask, starts, lengths)
        # each optional column as a table and each sequence's index into it
        sps = c.samplings
        tables: dict[str, tuple[list[Any], np.ndarray[Any, Any]]] = {
            "role": (c.names, view.role),
            "group_key": (c.keys, view.key),
            "temperature": ([float(sp.temperature) for sp in sps], view.sampling),
            "top_p": ([float(sp.top_p) for sp in sps], view.sampling),
            "top_k": ([int(sp.top_k) for sp in sps], view.sampling),
        }
        defaults = {col: _all_equal(t, idx, trajectories.DEFAULTS[col]) for col, (t, idx) in tables.items()}
        return cls(
            masked.tolist(),
            oldest.tolist(),
            masked,
            oldest,
            # object tables: indexing hands back the very Python values a per-sequence lookup would
            {col: _looked_up(t, idx) for col, (t, idx) in tables.items() if not defaults[col]},
            (trajectories.layout_of(defaults), trajectories.layout_of(defaults | {"status": True})),
        )


def _all_equal(table: list[Any], idx: np.ndarray[Any, Any], value: Any) -> bool:
    """Whether table[i] is `value` (of its type: 1 is not 1.0 here) for every index of a column: a
    table of one entry, the usual case, is read without the column."""
    if len(table) == 1:
        only = table[0]
        return type(only) is type(value) and only == value
    return all(type(table[k]) is type(value) and table[k] == value for k in np.unique(idx).tolist())


def _looked_up(table: list[Any], idx: np.ndarray[Any, Any]) -> list[Any]:
    """table[i] for every index of a column, the very Python values (a table of one value, the usual
    sampling settings, is that value repeated; others index a numpy object array)."""
    if len(table) == 1:
        return table * len(idx)
    out = np.empty(len(table), object)
    out[:] = table
    return list(out[idx].tolist())


def _column_rows(
    g: Group, view: ResultColumns, f: _Facts, a: int, b: int, layout: trajectories.Layout
) -> Iterator[tuple[Any, ...]]:
    """The trajectory rows of the column group a..b-1 in `layout`: slices of the message's
    per-sequence lists (a value repeated for the group's fields that are one for all of it) zipped
    into row tuples in C."""
    n = b - a
    if n <= 0:
        return iter(())
    if len(g.advantages) != n:
        raise ValueError(f"{len(g.advantages)} advantages for a group of {n} sequences")
    # none in the usual layout: every optional column at its default
    optional = [repeat(g.status, n) if col == "status" else f.optional[col][a:b] for col in layout]
    return zip(
        repeat(g.task_id, n),
        repeat(view.cols.names[int(view.policy[a])], n),
        repeat(g.prompt_key, n),
        view.reward_list[a:b],
        map(float, g.advantages),
        f.masked[a:b],
        f.oldest[a:b],
        range(g.first_id, g.first_id + n),
        *optional,
        strict=True,
    )


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
    lengths = np.array([len(seqs[i].loss_mask) for i in idx], np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths[:-1])))
    for k, v in zip(idx, _oldest(versions, mask, starts, lengths).tolist(), strict=True):
        out[k] = v
    return out


def _oldest(
    versions: np.ndarray[Any, Any],
    mask: np.ndarray[Any, Any],
    starts: np.ndarray[Any, Any],
    lengths: np.ndarray[Any, Any],
) -> np.ndarray[Any, Any]:
    """min_versions of the sequences whose joined versions and (bool) mask start at `starts` with
    these lengths (a sequence of no tokens: -1), as int64."""
    if not len(starts):
        return np.zeros(0, np.int64)
    known = versions >= 0
    # a sentinel after the last token: reduceat needs every start inside the array, and an empty
    # sequence at the end starts there
    generated = np.minimum.reduceat(np.append(np.where(mask & known, versions, _NONE), _NONE), starts)
    present = np.minimum.reduceat(np.append(np.where(known, versions, _NONE), _NONE), starts)
    oldest = np.where(generated != _NONE, generated, present)
    oldest[(oldest == _NONE) | (lengths == 0)] = -1
    return oldest.astype(np.int64)

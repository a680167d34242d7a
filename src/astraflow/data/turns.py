"""Policy turns of a sequence, as the data stages see them: generated length and truncation per turn.

A workflow that builds its sequences with `workflows.transcript.Transcript` records the turns on the
Sequence (exact: truncation comes from the engine's finish reason). Otherwise each maximal run of 1s
in loss_mask is one turn, truncated when it is at least max_new_tokens long.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from astraflow.protocol.messages import PackedSequence, Sequence


@dataclass(frozen=True)
class Turn:
    """One policy turn of a sequence."""

    start: int
    """Index of its first generated token in Sequence.tokens."""
    length: int
    """Generated tokens."""
    truncated: bool
    """It hit max_new_tokens without a stop token."""


_NONZERO_RUN = re.compile(rb"[^\x00]+")


def mask_runs(loss_mask: list[int] | bytes) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of non-zero entries (a packed uint8 mask or a list)."""
    try:
        packed = bytes(loss_mask)  # a checked mask holds only 0 and 1: the runs are found in C
    except (ValueError, TypeError):
        packed = None
    if packed is not None:
        return [(mt.start(), mt.end() - mt.start()) for mt in _NONZERO_RUN.finditer(packed)]
    runs: list[tuple[int, int]] = []
    start = -1
    for i, m in enumerate(loss_mask):
        if m and start < 0:
            start = i
        elif not m and start >= 0:
            runs.append((start, i - start))
            start = -1
    if start >= 0:
        runs.append((start, len(loss_mask) - start))
    return runs


def sequence_turns(seq: Sequence | PackedSequence, max_new_tokens: int) -> list[Turn]:
    """The policy turns of `seq`: recorded ones if present, else derived from its loss mask."""
    if seq.turns is not None:
        return [Turn(int(s), int(n), bool(t)) for s, n, t in seq.turns]
    return [Turn(s, n, n >= max_new_tokens) for s, n in mask_runs(seq.loss_mask)]


def turns_problem(seq: Sequence | PackedSequence) -> str:
    """Why `seq.turns` cannot describe `seq` ('' when it can or is absent): each turn must lie inside
    the tokens, on loss-mask 1 only, in order and without overlap (a packed sequence's token count is
    its mask's: the caller checked that the arrays agree)."""
    if seq.turns is None:
        return ""
    n = len(seq.loss_mask) if isinstance(seq, PackedSequence) else len(seq.tokens)
    end = 0
    for k, (start, length, _) in enumerate(seq.turns):
        if start < end or length < 0 or start + length > n:
            return f"turn {k} ({start}, {length}) is out of order or outside the {n} tokens"
        if not all(seq.loss_mask[start : start + length]):
            return f"turn {k} covers tokens with loss_mask 0"
        end = start + length
    return ""

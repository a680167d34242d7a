"""Micro-batches of a training batch: which sequences go together, and how they become tensors.

Two layouts share one output format:

- padded: one sequence per row, rows right-padded to the longest (an attention mask hides the padding);
- packed: several sequences per row, no padding between them. Each sequence's position ids restart at
  0, and no attention mask is passed, so transformers derives a block-diagonal causal mask from the
  position ids (document masking: no token attends across a sequence boundary).

Either way the loss sees the same [sequences, longest-1] views (mask, behaviour logprobs, advantages),
and `src` maps each trained position of those views to the flat hidden-state index that predicts it,
so only trained tokens meet the output embedding.

Sequences are assigned to micro-batches (and, under several ranks, to ranks) by tokens, not count:
longest first, each to the currently lightest micro-batch.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from astraflow.protocol.messages import TrainSample


def balance(lengths: list[int], bins: int) -> list[list[int]]:
    """Indices of `lengths` split into `bins` groups of near-equal token sums (longest first to the
    lightest group); deterministic, each group in ascending index order."""
    bins = max(1, bins)
    heap = [(0, b) for b in range(bins)]
    groups: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        groups[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(g) for g in groups]


def plan(
    samples: list[TrainSample],
    *,
    micro_batch: int,
    micro_batch_tokens: int,
    world: int = 1,
    rank: int = 0,
) -> list[list[int]]:
    """This rank's micro-batches of one update, as lists of sample indices.

    micro_batch_tokens 0 and one rank keeps the original order, `micro_batch` sequences at a time.
    Otherwise the update's sequences are balanced by tokens into world x k groups, k the same on every
    rank (so every rank runs the same number of forward/backward passes); a group may be empty.
    """
    lengths = [len(s.tokens) for s in samples]
    if micro_batch_tokens <= 0 and world == 1:
        return [
            list(range(i, min(i + micro_batch, len(samples)))) for i in range(0, len(samples), micro_batch)
        ]
    if micro_batch_tokens > 0:
        k = max(1, -(-sum(lengths) // (world * micro_batch_tokens)))
    else:
        k = max(1, -(-len(samples) // (world * micro_batch)))
    groups = balance(lengths, world * k)
    return groups[rank::world]


@dataclass
class MicroBatch:
    """Tensors of one micro-batch (on the trainer's device)."""

    input_ids: torch.Tensor
    """[R, W] token ids of the rows."""
    position_ids: torch.Tensor
    """[R, W] positions, restarting at 0 for every packed sequence."""
    attention_mask: torch.Tensor | None
    """[R, W] 1/0 padding mask (padded layout), None for packed rows (document masking from positions)."""
    src: torch.Tensor
    """[M] flat index into the rows' hidden states [R*W] of each trained position."""
    dst: torch.Tensor
    """[M] flat index into the loss views [B*L] of each trained position."""
    targets: torch.Tensor
    """[M] the token each trained position predicts."""
    temperature: torch.Tensor
    """[M] sampling temperature of the trained position's sequence."""
    top_p: torch.Tensor
    """[M] top-p of the trained position's sequence."""
    top_k: torch.Tensor
    """[M] top-k of the trained position's sequence."""
    mask: torch.Tensor
    """[B, L] 1.0 where a token is trained on (L = longest sequence - 1)."""
    behaviour: torch.Tensor
    """[B, L] behaviour logprobs."""
    adv: torch.Tensor
    """[B] advantages."""
    sequences: int
    """B: sequences in this micro-batch (0 for an empty filler)."""
    filtered: bool = True
    """Whether any sequence samples with top-p or top-k (known on the host: no device check needed)."""
    one_per_row: bool = False
    """Every row holds one sequence from position 0 (padding only after it): plain causal attention is
    exact for every real token, so no mask needs building."""

    @property
    def view_shape(self) -> tuple[int, int]:
        """(B, L) of the loss views."""
        return (self.mask.shape[0], self.mask.shape[1])


def _longs(xs: Sequence[int]) -> torch.Tensor:
    """A Python int list as an int64 tensor (through array: a C loop, ~20x faster than torch.tensor)."""
    return torch.frombuffer(array("q", xs), dtype=torch.long) if xs else torch.zeros(0, dtype=torch.long)


def _floats(xs: Sequence[float]) -> torch.Tensor:
    """A Python float list as a float32 tensor (through array, like _longs)."""
    return torch.frombuffer(array("f", xs), dtype=torch.float32) if xs else torch.zeros(0)


def _rows(lengths: list[int], pack: bool, row_tokens: int) -> list[list[int]]:
    """Sequences (indices) per row: one each when not packing, else first-fit decreasing into rows
    of `row_tokens` (0 = a single row for all)."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    if row_tokens <= 0:
        return [list(range(len(lengths)))]
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, load in enumerate(loads):
            if load + lengths[i] <= row_tokens:
                rows[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            rows.append([i])
            loads.append(lengths[i])
    return rows


def build(
    samples: list[TrainSample], *, pack: bool, row_tokens: int, pad_id: int, device: torch.device
) -> MicroBatch:
    """Tensors of one micro-batch of `samples` in the padded or packed layout."""
    if not samples:
        # A filler for a rank with nothing to do this pass: one pad token, nothing trained.
        one = torch.full((1, 1), pad_id, dtype=torch.long)
        empty_l = torch.zeros(0, dtype=torch.long)
        empty_f = torch.zeros(0, dtype=torch.float32)
        return MicroBatch(
            input_ids=one.to(device),
            position_ids=torch.zeros_like(one).to(device),
            attention_mask=None,
            src=empty_l.to(device),
            dst=empty_l.to(device),
            targets=empty_l.to(device),
            temperature=empty_f.to(device),
            top_p=empty_f.to(device),
            top_k=empty_l.to(device),
            mask=torch.zeros((0, 0)).to(device),
            behaviour=torch.zeros((0, 0)).to(device),
            adv=empty_f.to(device),
            sequences=0,
            filtered=False,
            one_per_row=True,
        )
    for s in samples:
        if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == len(s.tokens)):
            raise ValueError(f"sample {s.traj_id}: tokens, loss_mask, logprobs and versions differ in length")
    lengths = [len(s.tokens) for s in samples]
    rows = _rows(lengths, pack, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    b, view_len = len(samples), max(lengths) - 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((b, max(view_len, 0)), dtype=torch.float32)
    behaviour = torch.zeros_like(mask)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    tgt: list[torch.Tensor] = []
    settings: list[tuple[float, float, int, int]] = []
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            s, n = samples[i], lengths[i]
            toks = _longs(s.tokens)
            ids[r, start : start + n] = toks
            pos[r, start : start + n] = torch.arange(n)
            attn[r, start : start + n] = 1
            # Position j of the views is token j+1, predicted by the hidden state at token j.
            trained = _floats(s.loss_mask[1:])
            mask[i, : n - 1] = trained
            behaviour[i, : n - 1] = _floats(s.logprobs[1:])
            j = trained.nonzero().squeeze(-1)
            src.append(r * width + start + j)
            dst.append(i * view_len + j)
            tgt.append(toks[1:][j])
            settings.append((s.temperature, s.top_p, s.top_k, int(j.numel())))
            start += n
        if pack and start < width:
            # Trailing padding is its own "sequence" (positions from 0) so nothing attends into it.
            pos[r, start:] = torch.arange(width - start)
    counts = torch.tensor([c for *_, c in settings], dtype=torch.long)
    temp = torch.tensor([t for t, *_ in settings], dtype=torch.float32).repeat_interleave(counts)
    top_p = torch.tensor([p for _, p, _, _ in settings], dtype=torch.float32).repeat_interleave(counts)
    top_k = torch.tensor([k for _, _, k, _ in settings], dtype=torch.long).repeat_interleave(counts)
    padded = bool((attn == 0).any())
    return MicroBatch(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        attention_mask=attn.to(device) if (padded and not pack) else None,
        src=torch.cat(src).to(device),
        dst=torch.cat(dst).to(device),
        targets=torch.cat(tgt).to(device),
        temperature=temp.to(device),
        top_p=top_p.to(device),
        top_k=top_k.to(device),
        mask=mask.to(device),
        behaviour=behaviour.to(device),
        adv=torch.tensor([s.advantage for s in samples], dtype=torch.float32).to(device),
        sequences=b,
        # Conservative: a top_k at or above the vocabulary also counts (the exact path, only slower).
        filtered=any(p < 1.0 or k > 0 for _, p, k, _ in settings),
        one_per_row=all(len(row) == 1 for row in rows),
    )

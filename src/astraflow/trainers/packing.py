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
from dataclasses import dataclass

import numpy as np
import torch

from astraflow.protocol import packed
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

    micro_batch_tokens 0 and one rank: `micro_batch` sequences at a time in order of length (ties in
    the original order), each micro-batch in index order. A padded row is as long as its micro-batch's
    longest sequence, so with long-tailed lengths the arrival order would pad most short sequences to
    a long one; the loss sums over micro-batches, so which sequences share one changes no gradient
    beyond float rounding. Otherwise the update's sequences are balanced by tokens into world x k
    groups, k the same on every rank (so every rank runs the same number of forward/backward passes);
    a group may be empty.
    """
    lengths = [s.length for s in samples]
    if micro_batch_tokens <= 0 and world == 1:
        by_length = sorted(range(len(samples)), key=lengths.__getitem__)  # stable: ties keep their order
        return [sorted(by_length[i : i + micro_batch]) for i in range(0, len(samples), micro_batch)]
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
    """[B] advantages ([B, L] per-token ones once a value model has computed GAE)."""
    sequences: int
    """B: sequences in this micro-batch (0 for an empty filler)."""
    filtered: bool = True
    """Whether any sequence samples with top-p or top-k (known on the host: no device check needed)."""
    versions: torch.Tensor | None = None
    """[B, L] weight version that generated each token of the views (-1 where none)."""
    rewards: torch.Tensor | None = None
    """[B] episode rewards (what GAE discounts back over the trained tokens)."""
    one_per_row: bool = False
    """Every row holds one sequence from position 0 (padding only after it): plain causal attention is
    exact for every real token, so no mask needs building."""

    @property
    def view_shape(self) -> tuple[int, int]:
        """(B, L) of the loss views."""
        return (self.mask.shape[0], self.mask.shape[1])


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
    samples: list[TrainSample],
    *,
    pack: bool,
    row_tokens: int,
    pad_id: int,
    device: torch.device,
    width_multiple: int = 1,
) -> MicroBatch:
    """Tensors of one micro-batch of `samples` in the padded or packed layout. `width_multiple` rounds
    the rows' width up to a multiple of it (padding after the last sequence of each row): a compiled
    model then sees widths that keep the alignment its kernels were specialised for, instead of
    recompiling when a width breaks it."""
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
            rewards=empty_f.to(device),
            sequences=0,
            versions=torch.zeros((0, 0), dtype=torch.long).to(device),
            filtered=False,
            one_per_row=True,
        )
    for s in samples:
        if not (4 * len(s.loss_mask) == len(s.logprobs) == len(s.versions) == len(s.tokens)):
            raise ValueError(f"sample {s.traj_id}: tokens, loss_mask, logprobs and versions differ in length")
    lengths = [s.length for s in samples]
    rows = _rows(lengths, pack, row_tokens)
    step = max(1, width_multiple)
    width = -(-max(sum(lengths[i] for i in row) for row in rows) // step) * step
    b, view_len = len(samples), max(lengths) - 1
    span = max(view_len, 0)
    # Flat arrays filled by slices of each sample's packed bytes (one copy each), then one tensor each:
    # a tensor per sequence costs more than the whole micro-batch when sequences are short.
    ids_l = np.full(len(rows) * width, pad_id, dtype=np.int64)
    pos_l = np.zeros(len(rows) * width, dtype=np.int64)
    attn_l = np.zeros(len(rows) * width, dtype=np.int64)
    mask_l = np.zeros(b * span, dtype=np.float32)
    beh_l = np.zeros(b * span, dtype=np.float32)
    ver_l = np.full(b * span, -1, dtype=np.int64)
    first = [0] * b  # flat index of each sequence's first token in the rows
    for r, row in enumerate(rows):
        start, end = r * width, (r + 1) * width
        for i in row:
            s, n = samples[i], lengths[i]
            ids_l[start : start + n] = np.frombuffer(s.tokens, packed.INT32)
            pos_l[start : start + n] = np.arange(n)
            attn_l[start : start + n] = 1
            # Position j of the views is token j+1, predicted by the hidden state at token j.
            at, k = i * span, max(n - 1, 0)
            mask_l[at : at + k] = np.frombuffer(s.loss_mask, packed.UINT8)[1:]
            beh_l[at : at + k] = np.frombuffer(s.logprobs, packed.FLOAT32)[1:]
            ver_l[at : at + k] = np.frombuffer(s.versions, packed.INT32)[1:]
            first[i] = start
            start += n
        if pack and start < end:
            # Trailing padding is its own "sequence" (positions from 0) so nothing attends into it.
            pos_l[start:end] = np.arange(end - start)
    ids = torch.from_numpy(ids_l).reshape(len(rows), width)
    pos = torch.from_numpy(pos_l).reshape(len(rows), width)
    attn = torch.from_numpy(attn_l).reshape(len(rows), width)
    mask = torch.from_numpy(mask_l).reshape(b, span)
    behaviour = torch.from_numpy(beh_l).reshape(b, span)
    seq, j = mask.nonzero(as_tuple=True)
    src_t = torch.tensor(first, dtype=torch.long)[seq] + j
    # Trained positions in the rows' order (row by row, left to right), as the hidden states lie.
    order = torch.argsort(src_t, stable=True)
    seq, j, src_t = seq[order], j[order], src_t[order]
    targets = ids.reshape(-1)[src_t + 1]
    temp = torch.tensor([s.sampling.temperature for s in samples], dtype=torch.float32)[seq]
    top_p = torch.tensor([s.sampling.top_p for s in samples], dtype=torch.float32)[seq]
    top_k = torch.tensor([s.sampling.top_k for s in samples], dtype=torch.long)[seq]
    padded = sum(lengths) < len(rows) * width
    return MicroBatch(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        attention_mask=attn.to(device) if (padded and not pack) else None,
        src=src_t.to(device),
        dst=(seq * view_len + j).to(device),
        targets=targets.to(device),
        temperature=temp.to(device),
        top_p=top_p.to(device),
        top_k=top_k.to(device),
        mask=mask.to(device),
        behaviour=behaviour.to(device),
        adv=torch.tensor([s.advantage for s in samples], dtype=torch.float32).to(device),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32).to(device),
        sequences=b,
        versions=torch.from_numpy(ver_l).reshape(b, span).to(device),
        # Conservative: a top_k at or above the vocabulary also counts (the exact path, only slower).
        filtered=any(s.sampling.filtered() for s in samples),
        one_per_row=all(len(row) == 1 for row in rows),
    )

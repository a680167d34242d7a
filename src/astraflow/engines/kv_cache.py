"""The preallocated KV cache of the embedded engine: one fixed-size slot per sequence.

Keys and values of every layer live in one tensor [layers, slots, kv_heads, max_len + 1, head_dim],
allocated once. Running sequences occupy slots 0..n-1 (the engine compacts them when one finishes), so
a decode step over n rows reads plain views and a CUDA graph captured for a batch bucket always
addresses the same memory. Position `max_len` of every slot is scratch: padding rows of a decode
bucket write their keys there, so they never touch a live sequence. One slot beyond `slots` is scratch
too: padding prompts of a prefill bucket write their whole KV into it. Decode never addresses it (a
decode bucket's rows are slots 0..bucket-1, and buckets stop at `slots`).
"""

from __future__ import annotations

import torch

from astraflow.engines.device import to_device


class SlotKVCache:
    """Keys and values for `slots` sequences of at most `max_len` positions each."""

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots = slots
        self.max_len = max_len
        shape = (layers, slots + 1, kv_heads, max_len + 1, head_dim)
        # Zeros, not empty: padding rows of a graph bucket read position 0 of free slots.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def scratch_position(self) -> int:
        """The position padding rows write to (never part of a sequence)."""
        return self.max_len

    @property
    def scratch_slot(self) -> int:
        """The slot padding prompts of a prefill write to (never holds a sequence)."""
        return self.slots

    def nbytes(self) -> int:
        """Bytes held by keys and values (the scratch slot included)."""
        return 2 * self.k.numel() * self.k.element_size()

    def copy_slot(self, src: int, dst: int | list[int], length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot(s) `dst` (a shared prompt prefix)."""
        if isinstance(dst, int):
            dst = [dst]
        if not dst or length <= 0:
            return
        for cache in (self.k, self.v):
            src_view = cache[:, src : src + 1, :, :length]
            if len(dst) == 1:
                cache[:, dst[0], :, :length].copy_(src_view[:, 0])
            else:
                idx = to_device(torch.tensor(dst), cache.device)
                cache[:, :, :, :length].index_copy_(1, idx, src_view.expand(-1, len(dst), -1, -1, -1))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a sequence from slot `src` to slot `dst` (compaction after a row finishes)."""
        if src != dst:
            self.copy_slot(src, dst, length)

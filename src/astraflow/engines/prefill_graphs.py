"""Prefill as CUDA graphs: an admission's prompts padded to a bucket shape, one graph per bucket.

An eager prefill of the Qwen3 forward launches about fifty kernels per layer; for the short prompts of
an admission that is host time, while the GPU work is a few milliseconds. A graph replays them all as
one launch. A bucket is (rows, width): the prompt count rounded up to a power of two, the longest
prompt to a power of two from `MIN_WIDTH` (at most the cache's `max_len + 1` positions); shapes over
`MAX_ROWS` rows or `MAX_TOKENS` padded tokens have no bucket and run eagerly at their own shape.

The padding is plain PyTorch and runs eagerly on any device (`Qwen3Forward.prefill` with a shape,
`CachedRunner.pad_prefill`), so the CPU tests check what the graphs replay: padding prompts write
into the cache's scratch slot, padding positions beyond a prompt into its own slot, where decode
overwrites them before reading them (`Qwen3Forward.prefill_packed`).

A graph's static input is one int64 buffer (ids, slots, last indices) refilled by one copy per
prefill; its output, the logits rows, is a static buffer too. The graphs of one runner share one
memory pool, so buckets add only their logits to it, not a set of activations each; a later capture
may therefore place its activations over an earlier bucket's logits, which is why the logits of a
prefill must be consumed (stream order suffices) before the next prefill replays. The decode graphs
keep pools of their own (engines/graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from astraflow.engines.graphs import _CAPTURING, capture
from astraflow.engines.qwen3_forward import Qwen3Forward

MIN_WIDTH = 16
"""The narrowest bucket: shorter prompts pad to it."""
MAX_ROWS = 64
"""The most prompts of a bucket (each bucket holds its [rows, vocab] logits for good)."""
MAX_TOKENS = 4096
"""The most padded tokens (rows x width) of a bucket: bounds the activations a capture holds."""


def _pow2_at_least(x: int, floor: int) -> int:
    b = floor
    while b < x:
        b *= 2
    return b


def bucket(n: int, width: int, max_len: int) -> tuple[int, int] | None:
    """The (rows, width) a prefill of `n` prompts, the longest `width` tokens, pads to; None when it
    runs at its own shape (too many rows or tokens)."""
    rows = _pow2_at_least(n, 1)
    w = min(_pow2_at_least(width, MIN_WIDTH), max_len + 1)
    if n <= 0 or width > w or rows > MAX_ROWS or rows * w > MAX_TOKENS:
        return None
    return rows, w


@dataclass
class _Graph:
    graph: Any
    inputs: torch.Tensor
    """`Qwen3Forward.pack_prefill`'s layout for the bucket's shape, on the device."""
    logits: torch.Tensor


class PrefillGraphs:
    """Replays a captured prefill per bucket, capturing it the first time the bucket runs."""

    def __init__(self, forward: Qwen3Forward) -> None:
        self.forward = forward
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, prompts: list[list[int]], slots: list[int], shape: tuple[int, int]) -> torch.Tensor:
        """Logits [n, V] at each prompt's last token; the prompts' KV lands in `slots`. The tensor is
        the graph's output buffer: use it (on the stream) before the next prefill replays."""
        g = self.graphs.get(shape) or self._capture(shape)
        # pinned through torch's caching host allocator, which keeps the block until the copy has run
        staging = self.forward.pack_prefill(prompts, slots, shape).pin_memory()
        g.inputs.copy_(staging, non_blocking=True)
        g.graph.replay()
        return g.logits[: len(prompts)]

    def _capture(self, shape: tuple[int, int]) -> _Graph:
        with _CAPTURING:
            return self._capture_alone(shape)

    def _capture_alone(self, shape: tuple[int, int]) -> _Graph:
        dev = self.forward.device
        rows, width = shape
        # every row a padding prompt: the warm-up runs write only the scratch slot
        inputs = self.forward.pack_prefill([], [], shape).to(dev)

        def step() -> torch.Tensor:
            return self.forward.prefill_packed(inputs, rows, width)

        graph, logits = capture(step, dev, self.pool)
        g = _Graph(graph, inputs, logits)
        self.graphs[shape] = g
        return g

"""CUDA graphs of the decode step, one per batch-size bucket, captured the first time a bucket runs.

A graph replays the whole step (every layer, the KV write, the logits) as one launch. Its inputs live
in a static [3, bucket] buffer (token, position, length per row) and its weights are the model's
parameters themselves, which weight updates overwrite in place with copy_, so a graph stays valid
across versions. Rows of a bucket beyond the batch are padding: they write keys at the cache's
scratch position and attend to one position, and their logits are dropped.

Several engines in one process (a RaaS holding two policies on one GPU) decode on threads of their
own. A capture is exclusive: one at a time in the process (`_CAPTURING`), and in CUDA's thread-local
mode, so that another engine's work on its own thread meanwhile (a pinned buffer, a decode step)
neither breaks the capture nor is refused. (Found on GPUs: two engines capturing a new bucket at the
same moment failed with "operation not permitted when stream is capturing".)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from astraflow.engines.qwen3_forward import Qwen3Forward

_CAPTURING = threading.Lock()
"""Held while a decode graph is warmed up and captured, by whichever engine of the process does it."""


@dataclass
class _Graph:
    graph: Any
    inputs: torch.Tensor
    """[3, bucket] int64 on the device: tokens, positions, lengths."""
    logits: torch.Tensor


def buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class DecodeGraphs:
    """Replays a captured decode step for the smallest bucket that holds the batch."""

    def __init__(self, forward: Qwen3Forward, ops: Any, max_batch: int) -> None:
        self.forward = forward
        self.ops = ops
        self.buckets = buckets(max_batch)
        self.graphs: dict[int, _Graph] = {}

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Logits [n, V] of one decode step for rows 0..n-1; `tokens` a host list, or a device tensor
        (the overlapped loop's sampled tokens, copied into the graph's input on the device)."""
        n = len(positions)
        bucket = next(b for b in self.buckets if b >= n)
        g = self.graphs.get(bucket) or self._capture(bucket)
        # A fresh pinned block each step from torch's caching host allocator, which hands it out again
        # only after the copy that reads it has run: with the overlapped loop the host fills the next
        # step's inputs while this step's copy may still wait in the stream.
        staging = torch.empty((3, bucket), dtype=torch.long, pin_memory=True)
        staging[0, :n] = 0 if isinstance(tokens, torch.Tensor) else torch.tensor(tokens)
        staging[1, :n] = torch.tensor(positions)
        staging[2, :n] = staging[1, :n] + 1
        self._pad(staging, n)
        g.inputs.copy_(staging, non_blocking=True)
        if isinstance(tokens, torch.Tensor):
            g.inputs[0, :n].copy_(tokens)
        g.graph.replay()
        return g.logits[:n]

    def _pad(self, buf: torch.Tensor, n: int) -> None:
        buf[0, n:] = 0
        buf[1, n:] = self.forward.cache.scratch_position
        buf[2, n:] = 1

    def _capture(self, bucket: int) -> _Graph:
        with _CAPTURING:
            return self._capture_alone(bucket)

    def _capture_alone(self, bucket: int) -> _Graph:
        dev = self.forward.device
        staging = torch.empty((3, bucket), dtype=torch.long).pin_memory()
        self._pad(staging, 0)
        inputs = staging.to(dev)
        span = self.forward.cache.max_len + 1

        def step() -> torch.Tensor:
            return self.forward.decode_step(inputs[0], inputs[1], inputs[2], span, self.ops)

        graph, logits = capture(step, dev)
        g = _Graph(graph, inputs, logits)
        self.graphs[bucket] = g
        return g


def capture(
    step: Callable[[], torch.Tensor], dev: torch.device, pool: Any = None
) -> tuple[Any, torch.Tensor]:
    """Run `step` twice on a side stream (compiles kernels, creates library handles, lets the attention
    pick its kernel), then capture it as one CUDA graph (in memory pool `pool`, else a pool of its own);
    the graph and the output buffer its replays write. Capture errors stay in this thread."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph, out

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
    staging: torch.Tensor
    """The same in pinned host memory."""
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

    def run(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [n, V] of one decode step for rows 0..n-1."""
        n = len(tokens)
        bucket = next(b for b in self.buckets if b >= n)
        g = self.graphs.get(bucket) or self._capture(bucket)
        g.staging[0, :n] = torch.tensor(tokens)
        g.staging[1, :n] = torch.tensor(positions)
        g.staging[2, :n] = g.staging[1, :n] + 1
        self._pad(g.staging, n)
        g.inputs.copy_(g.staging, non_blocking=True)
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

        # Warm up on a side stream (compiles kernels, creates library handles) before capturing.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = step()
        g = _Graph(graph, inputs, staging, logits)
        self.graphs[bucket] = g
        return g

"""The overlapped decode loop: the device runs step N+1 while the host does step N's bookkeeping.

`OverlapDecodeLoop` is `DecodeLoop` with the device one step ahead of the host. A step launches the
next decode from the tokens the last sampling left on the device (`_next`), queues this step's
sampling behind it and a copy of the sampled tokens and logprobs into pinned host memory, records a
CUDA event after the copy, and only then reads the previous step's copy (its event completed before
the step just launched started) and does that step's host work: record tokens, stop and length checks,
finished rows out, slot compaction. Nothing on that path waits for the device except the previous
step's event, so the host's per-step work runs while the GPU decodes.

What equals the synchronous loop, row by row: token k of a row is sampled from the logits of its own
prompt and tokens 0..k-1 under the weights in use when it was sampled, with the noise of (seed, k),
and tagged with that version; stop and length checks are the same function (`Row.record`). What
differs: a row that finished at step N is decoded once more at step N+1 and that token is discarded;
a completion comes back from the call after the one that sampled its last token; a finished row frees
its slot one call later; and the batch a step runs holds those finished rows for one more step, so
on hardware whose kernels are not batch-invariant a logprob can differ in its last bits (the same
holds in the synchronous loop for a request decoded beside other batch mates).

Safe points: admissions, slot moves, weight copies and the KV recompute are queued on the same CUDA
stream after the step in flight, so they happen between two device steps: the step in flight reads
the old weights and its tokens carry the old version (each read remembers the version it was sampled
under). At every return to the caller each running row has exactly one token the host has not read
(`Row.ahead == 1`): its KV is not written yet, so the recompute after a weight copy rebuilds the prompt
and every read token, as the synchronous loop rebuilds all but the last.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from astraflow.engines.base import Completion
from astraflow.engines.decode_loop import DecodeLoop, Row
from astraflow.engines.device import to_device
from astraflow.engines.sampler import lists, stacked

T = TypeVar("T")


@dataclass
class _Read(Generic[T]):
    """One sampling's tokens and logprobs on their way to the host."""

    rows: list[Row[T]]
    """The rows sampled, in the order of `host`'s columns (rows may move slots before it is read)."""
    host: torch.Tensor
    """[2, n] float64: tokens, logprobs; pinned host memory the copy fills (GPU) or the values (CPU)."""
    event: Any
    """A torch.cuda.Event recorded after the copy (None on a CPU)."""
    version: int
    """The weight version the tokens were sampled under."""


class OverlapDecodeLoop(DecodeLoop[T]):
    """Continuous batching with the host one step behind the device."""

    def __init__(
        self,
        runner: Any,
        params: dict[str, torch.Tensor],
        device: torch.device,
        max_batch: int,
        *,
        seed: int = 0,
    ) -> None:
        """As DecodeLoop; the runner's `decode` takes the input tokens as a device tensor."""
        super().__init__(runner, params, device, max_batch, seed=seed)
        self._next: torch.Tensor | None = None
        """[len(rows)] int64 on the device: each running row's newest sampled token, its next input."""
        self._reads: deque[_Read[T]] = deque()

    def step(self) -> list[tuple[T, Completion]]:
        """Launch one decode step for every running row, then read the step before it; returns the
        rows that the step before finished."""
        rows = self.rows
        if not rows:
            return []
        logits = self.runner.decode(self._next, [r.cached for r in rows])
        self._take(list(range(len(rows))), logits)
        self._read(keep=1)
        return self._finish_done()

    def recompute_cache(self) -> None:
        """As DecodeLoop's: rebuild the KV of each row's prompt and read tokens (its one unread token
        is the next input, its KV not written yet)."""
        if any(r.ahead != 1 for r in self.rows):
            raise RuntimeError("the KV recompute needs exactly one unread token per running row")
        super().recompute_cache()

    def drop(self) -> list[T]:
        """Forget every running row and every read in flight; the rows' tags, to fail."""
        self._reads.clear()
        self._next = None
        return super().drop()

    def _take(self, idx: list[int], logits: torch.Tensor) -> None:
        """Sample rows `idx` on the device, keep the tokens as their next inputs, queue their read."""
        rows = [self.rows[i] for i in idx]
        tok, lp = self.sampler.sample_on_device(
            logits,
            [r.request.sampling for r in rows],
            [r.seed for r in rows],
            [len(r.tokens) + r.ahead for r in rows],
        )
        for r in rows:
            r.ahead += 1
        self._reads.append(self._copy_out(rows, tok, lp))
        n = len(self.rows)
        if idx == list(range(n)):
            self._next = tok
            return
        if self._next is None or self._next.numel() < n:
            grown = torch.zeros(n, dtype=torch.int64, device=self.device)
            if self._next is not None:
                grown[: self._next.numel()].copy_(self._next)
            self._next = grown
        self._next.index_copy_(0, to_device(torch.tensor(idx), self.device), tok)

    def _copy_out(self, rows: list[Row[T]], tok: torch.Tensor, lp: torch.Tensor) -> _Read[T]:
        """Queue the copy of a sampling's results to the host, behind it on the stream."""
        both = stacked(tok, lp)
        if self.device.type != "cuda":
            return _Read(rows, both, None, self.version)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _Read(rows, host, event, self.version)

    def _read(self, keep: int) -> None:
        """Wait for and record every read but the newest `keep`; a token of a row that already
        finished is the wasted step's and is dropped."""
        while len(self._reads) > keep:
            read = self._reads.popleft()
            if read.event is not None:
                read.event.synchronize()
            tokens, logps = lists(read.host)
            for row, tok, lp in zip(read.rows, tokens, logps, strict=True):
                row.ahead -= 1
                if not row.finish_reason:
                    row.record(tok, lp, read.version)

    def _finish_done(self) -> list[tuple[T, Completion]]:
        """As DecodeLoop's, and the next inputs follow their rows to their new slots."""
        before = {id(r): i for i, r in enumerate(self.rows)}
        done = super()._finish_done()
        if not self.rows:
            # Every read left is of finished rows (the wasted step): nothing to record. Their pinned
            # blocks return to torch's host allocator, which reuses them only after the copies ran.
            self._reads.clear()
            self._next = None
        elif done and self._next is not None:
            order = [before[id(r)] for r in self.rows]
            self._next = self._next.index_select(0, to_device(torch.tensor(order), self.device))
        return done

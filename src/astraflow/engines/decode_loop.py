"""The embedded engine's model side: running rows in KV slots, admission, decode steps, weight copies.

`DecodeLoop` is synchronous and owns no thread, queue or event loop: a caller admits requests, steps,
and applies weights between steps, and each call returns the completions it finished, each with the
caller's tag (the engine's tag is where to deliver it). engines/torch_engine.py drives it from its
decode thread; a test can drive it directly, one call at a time. engines/overlap_loop.py is the same
loop with the device one step ahead of the host (`decode_loop = "overlap"`).

Rows occupy KV slots 0..n-1 (a finished row's slot is taken by the last row). Requests with the same
prompt (a GRPO group) are prefilled once and the prompt's KV copied into each sample's slot. Applied
weights are copied into the parameters in place; the running rows' KV is then recomputed under them,
so every behaviour logprob is exactly that of the version it is tagged with.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from astraflow.engines.base import Completion, GenerationRequest
from astraflow.engines.device import to_device
from astraflow.engines.sampler import Sampler

T = TypeVar("T")

_PREFILL_TOKENS = 16384
"""Most (padded) prompt tokens one prefill forward takes; longer admissions are split."""


@dataclass
class Row(Generic[T]):
    """A running sequence; it occupies the KV slot equal to its index in the loop's row list."""

    request: GenerationRequest
    tag: T
    seed: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    ahead: int = 0
    """Tokens sampled on the device that the host has not read yet (the overlapped loop's; 0 here)."""

    @property
    def prompt(self) -> list[int]:
        """The request's prompt."""
        return self.request.prompt_ids

    @property
    def cached(self) -> int:
        """Positions whose KV is in the slot (or queued to be): the prompt and every sampled token but
        the last (the next input), counting those not read yet."""
        return len(self.prompt) + len(self.tokens) + self.ahead - 1

    def record(self, token: int, logprob: float, version: int) -> None:
        """Take a sampled token and say whether it ends the sequence."""
        req = self.request
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in req.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= req.max_new_tokens:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        """What the caller gets back."""
        return Completion(
            self.tokens, self.logprobs, self.versions, self.finish_reason, self.request.sampling
        )


class DecodeLoop(Generic[T]):
    """Continuous batching over a runner's slot KV cache; every call runs to the device's end."""

    def __init__(
        self,
        runner: Any,
        params: dict[str, torch.Tensor],
        device: torch.device,
        max_batch: int,
        *,
        seed: int = 0,
    ) -> None:
        """`runner`: engines/runners.py's prefill/decode/slot moves; `params`: the model's parameters by
        name (what `apply_weights` copies into); `seed`: draws the seeds of requests that bring none."""
        self.runner = runner
        self.params = params
        self.device = device
        self.max_batch = max_batch
        self.sampler = Sampler(device, runner.uses_triton)
        self.rng = random.Random(seed)
        self.version = 0
        self.rows: list[Row[T]] = []
        self.prefill_forwards = 0
        """Prefill forwards `admit` ran (a GRPO group's prompt is one row of one forward)."""
        self.prefill_prompts = 0
        """Distinct prompts `admit` prefilled."""
        self.timeline: list[tuple[str, float]] | None = None
        """When a list, `admit` appends ("prefill", time) after each admission's prefill (with the
        device synchronised): the rollout bench splits prefill from decode with it."""

    @property
    def free(self) -> int:
        """Slots no row occupies."""
        return self.max_batch - len(self.rows)

    def apply_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checked weights into the parameters; decode steps from now on are `version`'s. The
        running rows' KV is still the old version's until `recompute_cache`."""
        with torch.no_grad():
            for name, value in tensors.items():
                self.params[name].copy_(value, non_blocking=True)
        self._sync()
        self.version = version

    def recompute_cache(self) -> None:
        """Rebuild the running rows' KV under the weights just applied."""
        seqs = [(r.prompt + r.tokens[: r.cached - len(r.prompt)], i) for i, r in enumerate(self.rows)]
        for chunk in _chunks(seqs):
            self.runner.prefill([s for s, _ in chunk], [i for _, i in chunk])
        self._sync()  # the recompute belongs to the weight update's time

    def admit(self, batch: list[tuple[GenerationRequest, T]]) -> list[tuple[T, Completion]]:
        """Give each request a slot (at most `free` of them); prefill each distinct prompt once and share
        its KV; sample every new row's first token. Returns what finished already."""
        done: list[tuple[T, Completion]] = []
        groups: dict[tuple[int, ...], list[int]] = {}
        for req, tag in batch:
            if req.max_new_tokens <= 0:
                done.append((tag, Completion([], [], [], "length", req.sampling)))
                continue
            seed = req.seed if req.seed is not None else self.rng.getrandbits(62)
            gen = None  # noise comes from (seed, token index) alone (Sampler): no generator per row
            groups.setdefault(tuple(req.prompt_ids), []).append(len(self.rows))
            self.rows.append(Row(req, tag, seed, gen))
        for chunk in _chunks([(list(prompt), slots) for prompt, slots in groups.items()]):
            logits = self.runner.prefill([prompt for prompt, _ in chunk], [slots[0] for _, slots in chunk])
            self.prefill_forwards += 1
            self.prefill_prompts += len(chunk)
            members: list[int] = []
            for i, (prompt, slots) in enumerate(chunk):
                self.runner.copy_slot(slots[0], slots[1:], len(prompt))
                members += [i] * len(slots)
            if len(members) > len(chunk):
                logits = logits[to_device(torch.tensor(members), logits.device)]
            self._take([s for _, slots in chunk for s in slots], logits)
        if self.timeline is not None:
            self._sync()
            self.timeline.append(("prefill", time.perf_counter()))
        return done + self._finish_done()

    def step(self) -> list[tuple[T, Completion]]:
        """One decode step for every running row; returns the rows it finished."""
        rows = self.rows
        logits = self.runner.decode([r.tokens[-1] for r in rows], [r.cached for r in rows])
        self._take(list(range(len(rows))), logits)
        return self._finish_done()

    def drop(self) -> list[T]:
        """Forget every running row (the engine closed or failed); their tags, to fail."""
        tags = [r.tag for r in self.rows]
        self.rows.clear()
        return tags

    def _sync(self) -> None:
        if self.device.type == "cuda":
            # this stream only: a device-wide sync would also wait for a weight receive posted on a
            # transport's own stream (a broadcast waiting for the trainer's next version)
            torch.cuda.current_stream(self.device).synchronize()

    def _take(self, idx: list[int], logits: torch.Tensor) -> None:
        """Sample the next token of rows `idx` from their logits and record it."""
        rows = [self.rows[i] for i in idx]
        tokens, logps = self.sampler.sample(
            logits,
            [r.request.sampling for r in rows],
            [r.seed for r in rows],
            [len(r.tokens) for r in rows],
            [r.generator for r in rows],
        )
        for row, tok, lp in zip(rows, tokens, logps, strict=True):
            row.record(tok, lp, self.version)

    def _finish_done(self) -> list[tuple[T, Completion]]:
        """Take finished rows out and compact the rest into slots 0..n-1 (highest index first, so a
        row moved down is never one that has finished)."""
        rows = self.rows
        done: list[tuple[T, Completion]] = []
        for i in [i for i, r in enumerate(rows) if r.finish_reason][::-1]:
            done.append((rows[i].tag, rows[i].completion()))
            last = len(rows) - 1
            if i != last:
                self.runner.move_slot(last, i, rows[last].cached)
                rows[i] = rows[last]
            rows.pop()
        return done[::-1]


def _chunks(items: list[tuple[list[int], Any]]) -> list[list[tuple[list[int], Any]]]:
    """Split (sequence, tag) items into prefill calls of at most _PREFILL_TOKENS padded tokens."""
    out: list[list[tuple[list[int], Any]]] = []
    cur: list[tuple[list[int], Any]] = []
    width = 0
    for item in items:
        w = max(width, len(item[0]))
        if cur and w * (len(cur) + 1) > _PREFILL_TOKENS:
            out.append(cur)
            cur, w = [], len(item[0])
        cur.append(item)
        width = w
    if cur:
        out.append(cur)
    return out

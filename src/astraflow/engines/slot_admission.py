"""Which queued requests the embedded engine admits into free KV slots, and when.

Every admission is a prefill: an eager forward over the model's layers for the prompts admitted, its
cost on a GPU mostly launches whatever the number of rows. Admitting into every slot the moment it
frees (`min_free = 0`, the greedy rule) makes an admission of most decode steps and splits a GRPO
group (one prompt, queued together) across several of them, prefilling its prompt again each time.

The rule while rows decode: wait until `min_free` slots are free (or everything queued fits, or the
oldest queued request has waited more than `max_wait` decode steps), then take whole same-prompt runs
in queue order, skipping a run that does not fit (it keeps its place at the front). Past `max_wait`
the greedy rule admits from the front, so nothing waits longer than that for a slot that is free.
With no row decoding the greedy rule applies at once: an idle engine fills every slot it can.

Which step a request is admitted on does not change what it samples: noise comes from (seed, token
index) alone (engines/sampler.py), and the engine gives an unseeded request its seed when it is
queued, not when it is admitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Queued(Protocol):
    """What the rule reads of a queued request."""

    @property
    def run(self) -> int:
        """Equal for neighbours in the queue with the same prompt (one prefill serves them)."""
        ...

    @property
    def step(self) -> int:
        """The engine's decode-step count when the request was queued."""
        ...


@dataclass(frozen=True)
class SlotAdmission:
    """The admission rule of one engine (TorchEngineConfig's admit_min_free and admit_max_wait)."""

    max_batch: int
    min_free: int
    """Free slots that open an admission while rows decode (capped at max_batch); 0: greedy."""
    max_wait: int
    """Decode steps the oldest queued request may wait before the greedy rule admits it."""

    def pick(self, queue: Sequence[Queued], free: int, running: int, step: int) -> list[int]:
        """Indices into `queue` (ascending) of the requests to admit now into `free` slots, with
        `running` rows decoding at decode step `step`."""
        n = len(queue)
        if not n or free <= 0:
            return []
        greedy = self.min_free == 0 or running == 0 or step - queue[0].step > self.max_wait
        if greedy or n <= free:
            return list(range(min(free, n)))
        if free < min(self.min_free, self.max_batch):
            return []
        picked: list[int] = []
        for start, end in runs(queue, self.max_batch):
            if end - start <= free - len(picked):
                picked += range(start, end)
                if len(picked) == free:
                    break
        return picked


def runs(queue: Sequence[Queued], cap: int) -> list[tuple[int, int]]:
    """The queue cut into same-prompt runs, [start, end) each, none longer than `cap` (a group larger
    than the engine is admitted in pieces)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(queue) + 1):
        if i == len(queue) or queue[i].run != queue[start].run or i - start == cap:
            out.append((start, i))
            start = i
    return out

"""Which queued requests the embedded engine admits into free KV slots, and when.

Every admission is a prefill: an eager forward over the model's layers for the prompts admitted, its
cost on a GPU mostly launches whatever the number of rows. Admitting into every slot the moment it
frees (`min_free = 0`, the greedy rule) makes an admission of most decode steps and splits a GRPO
group (one prompt, queued together) across several of them, prefilling its prompt again each time.

The rule while rows decode: wait until `min_free` slots are free (or everything queued fits), then
take whole same-prompt runs in queue order, skipping a run that does not fit (it keeps its place at
the front). Once the request at the front has been passed over for `max_wait` decode steps while slots
were free (held back under `min_free`, or its group did not fit and others went ahead), the greedy
rule admits from the front into whatever is free, splitting its group if need be: free slots never
wait longer than that for queued work, and nothing waits for ever behind smaller groups. The count
starts when slots are free, not when the request was queued: in a full engine every queued request
waits for rows to finish, and counting that would make the rule greedy whenever the engine is busy.
With no row decoding the greedy rule applies at once: an idle engine fills every slot it can.

Which step a request is admitted on does not change what it samples: noise comes from (seed, token
index) alone (engines/sampler.py), and the engine gives an unseeded request its seed when it is
queued, not when it is admitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Queued(Protocol):
    """What the rule reads of a queued request."""

    @property
    def run(self) -> int:
        """Equal for neighbours in the queue with the same prompt (one prefill serves them)."""
        ...


class SlotAdmission:
    """The admission rule of one engine (TorchEngineConfig's admit_min_free and admit_max_wait).
    Asked once per pass of the decode loop (a decode step while rows run); it counts the passes in
    which the request at the front of the queue was passed over while slots were free."""

    def __init__(self, max_batch: int, min_free: int, max_wait: int) -> None:
        """`min_free`: free slots that open an admission while rows decode (capped at max_batch; 0:
        greedy); `max_wait`: passes over the front request, with slots free, before greedy."""
        self.max_batch = max_batch
        self.min_free = min(min_free, max_batch)
        self.max_wait = max_wait
        self.passed_over = 0
        """Passes since the front request's wait with free slots began (reset when it is admitted)."""

    def pick(self, queue: Sequence[Queued], free: int, running: int) -> list[int]:
        """Indices into `queue` (ascending) of the requests to admit now into `free` slots, with
        `running` rows decoding."""
        n = len(queue)
        if not n:
            self.passed_over = 0
            return []
        if free <= 0:
            return []
        greedy = self.min_free == 0 or running == 0 or self.passed_over >= self.max_wait
        if greedy or n <= free:
            self.passed_over = 0
            return list(range(min(free, n)))
        picked: list[int] = []
        if free >= self.min_free:
            for start, end in runs(queue, self.max_batch):
                if end - start <= free - len(picked):
                    picked += range(start, end)
                    if len(picked) == free:
                        break
        self.passed_over = 0 if picked[:1] == [0] else self.passed_over + 1
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

"""The embedded engine's counters: how long its decode thread kept the device busy, and on what; how
many admissions it made and how many prefill forwards they cost (engines/slot_admission.py)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any


class EngineStats:
    """Cumulative wall time of the decode thread's phases (with the synchronous decode loop each ends
    with the device synchronised; with the overlapped one a step's phase ends when the next step is
    queued and the one before it read, so the device keeps running across the phase boundary).

    busy_s = weight_s + prefill_s + decode_s: the time the engine kept its device working (kernels plus
    the host work between them); over a worker's wall time it is the engine's busy fraction. starved_s:
    the time the decode thread waited with no row to decode and nothing queued (waiting for requests:
    the rest of the wall time, neither busy nor starved, is host work between passes). Written by
    the decode thread, read by others: plain float updates under the GIL, snapshots may be a step old."""

    def __init__(self) -> None:
        self.started = time.time()
        self.weight_s = 0.0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.starved_s = 0.0
        self._starved_since: float | None = None
        """perf_counter() when the wait for requests now under way began (None: not waiting)."""
        self.decode_steps = 0
        self.row_steps = 0
        self.applies: deque[tuple[int, float, float, float]] = deque(maxlen=256)
        """(version, wall time it was applied, seconds the copy and the KV recompute took, seconds of
        those the recompute of the running rows' KV took)."""
        self.n_applied = 0
        self.admissions = 0
        """Passes of the decode loop that admitted requests."""
        self.admitted_rows = 0
        """Requests admitted (rows given a slot, or finished at once with max_new_tokens 0)."""
        self.prefill_forwards = 0
        """Prefill forwards of those admissions (the weight update's KV recompute not counted)."""
        self.prefill_prompts = 0
        """Distinct prompts those forwards prefilled (a group's shared prompt counts once)."""

    def add(self, weight_s: float, prefill_s: float, decode_s: float, rows: int) -> None:
        """One pass of the decode loop."""
        self.weight_s += weight_s
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        if rows:
            self.decode_steps += 1
            self.row_steps += rows

    def starving(self) -> None:
        """The decode thread begins to wait for requests, with no row to decode."""
        self._starved_since = time.perf_counter()

    def fed(self) -> None:
        """That wait ended."""
        since, self._starved_since = self._starved_since, None
        if since is not None:
            self.starved_s += time.perf_counter() - since

    def admitted(self, rows: int, forwards: int, prompts: int) -> None:
        """One admission: `rows` requests, prefilled by `forwards` forwards over `prompts` prompts."""
        self.admissions += 1
        self.admitted_rows += rows
        self.prefill_forwards += forwards
        self.prefill_prompts += prompts

    def applied(self, version: int, seconds: float, recompute_s: float = 0.0) -> None:
        """A weight version went live in `seconds`, `recompute_s` of them rebuilding running rows' KV."""
        self.applies.append((version, time.time(), seconds, recompute_s))
        self.n_applied += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters as plain numbers."""
        return {
            "started": self.started,
            "busy_s": self.weight_s + self.prefill_s + self.decode_s,
            "weight_s": self.weight_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            # a wait under way counts up to now, so two snapshots' difference is the wait between them
            "starved_s": self.starved_s
            + (time.perf_counter() - since if (since := self._starved_since) is not None else 0.0),
            "decode_steps": self.decode_steps,
            "row_steps": self.row_steps,
            "n_applied": self.n_applied,
            "admissions": self.admissions,
            "admitted_rows": self.admitted_rows,
            "prefill_forwards": self.prefill_forwards,
            "prefill_prompts": self.prefill_prompts,
            "applies": [list(a) for a in self.applies],
        }

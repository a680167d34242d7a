"""The run moves: a result accepted, a batch recorded or a version published resets the stall clock
(dataflow/stall.py; lifecycle.py checks it)."""

from __future__ import annotations

import time

from astraflow.dataflow.stall import Progress
from astraflow.state.store import Store


def made_progress(store: Store, progress: Progress, now: float | None = None) -> None:
    """Note that the run moved at `now`; a stall that was reported gets its `unstalled` event."""
    t = time.time() if now is None else now
    if progress.warned_at is not None:
        with store.write():
            store.add_event("unstalled", f"progress after {t - progress.last:.0f}s")
        progress.warned_at = None
    progress.last = t

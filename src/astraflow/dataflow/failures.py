"""Failed task attempts: counted by reason (shown by `status`), and the run-ending rule.

The counts live in the stage_state table under policy "" (no schema change), written in the same
transaction as the ledger update they count. A run ends with exit 1 once the newest
`rollout.max_failed_tasks` tasks to finish all failed every attempt: a workflow or a worker that
fails everything would otherwise spin forever.
"""

from __future__ import annotations

import time

from astraflow.state.failure_counts import ROW_POLICY, ROW_STAGE, counts, failed_streak, tail
from astraflow.state.store import Store

REASONS = ("workflow_error", "task_timeout", "invalid_result", "lease_expired")


def reason_of(error: str) -> str:
    """The reason class of an attempt's error text."""
    if error.startswith("invalid result"):
        return "invalid_result"
    if error.startswith("task_timeout"):
        return "task_timeout"
    if error.startswith("lease expired"):
        return "lease_expired"
    return "workflow_error"


def record(store: Store, error: str, n: int = 1) -> str:
    """Count n failed attempts with this error (inside the caller's transaction); returns the reason."""
    reason = reason_of(error)
    with store.write():
        state = counts(store)
        by = dict(state.get("by_reason", {}))
        by[reason] = int(by.get(reason, 0)) + n
        state.update({"by_reason": by, "last_error": tail(error, 2000), "updated": time.time()})
        store.save_stage_state(ROW_POLICY, ROW_STAGE, "failures", state)
    return reason


__all__ = ["REASONS", "ROW_POLICY", "ROW_STAGE", "counts", "failed_streak", "reason_of", "record", "tail"]

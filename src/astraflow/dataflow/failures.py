"""Failed task attempts: counted by reason (shown by `status`), and the run-ending rule.

The counts live in the stage_state table under policy "" (no schema change), written in the same
transaction as the ledger update they count. A run ends with exit 1 once the newest
`rollout.max_failed_tasks` tasks to finish all failed every attempt: a workflow or a worker that
fails everything would otherwise spin forever.
"""

from __future__ import annotations

import json
import time
from typing import Any

from astraflow.state.store import Store

ROW_POLICY, ROW_STAGE = "", -2
"""Where the counts live in stage_state."""
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


def tail(error: str, n: int) -> str:
    """The last n characters of an error: a traceback's summary line (the exception) is at its end."""
    return error if len(error) <= n else "..." + error[-(n - 3) :]


def counts(store: Store) -> dict[str, Any]:
    """Reason -> failed attempts so far, plus `last_error` (the newest error text, capped)."""
    try:
        v = store.scalar(
            "SELECT state FROM stage_state WHERE policy = ? AND stage = ?", (ROW_POLICY, ROW_STAGE)
        )
    except Exception:  # a state file from before this table existed
        return {}
    return dict(json.loads(v)) if v else {}


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


def failed_streak(store: Store, n: int) -> bool:
    """True when the newest n finished tasks (done or failed) all failed every attempt (n > 0)."""
    if n <= 0:
        return False
    rows = store.query(
        "SELECT status FROM tasks WHERE status IN ('done', 'failed') ORDER BY updated DESC, id DESC LIMIT ?",
        (n,),
    )
    return len(rows) == n and all(r["status"] == "failed" for r in rows)

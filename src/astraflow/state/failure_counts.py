"""Failed task attempts as stored: counts by reason in stage_state under policy "", and the newest
finished tasks (dataflow/failures.py counts them and holds the run-ending rule)."""

from __future__ import annotations

import json
from typing import Any

from astraflow.state.store import Store

ROW_POLICY, ROW_STAGE = "", -2
"""Where the counts live in stage_state."""


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


def failed_streak(store: Store, n: int) -> bool:
    """True when the newest n finished tasks (done or failed) all failed every attempt (n > 0)."""
    if n <= 0:
        return False
    rows = store.query(
        "SELECT status FROM tasks WHERE status IN ('done', 'failed') ORDER BY updated DESC, id DESC LIMIT ?",
        (n,),
    )
    return len(rows) == n and all(r["status"] == "failed" for r in rows)

"""The operator's paused set as stored: in stage_state under policy "" (dataflow/control.py holds the rules)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from astraflow.state.store import Store

ROW_POLICY, ROW_STAGE = "", -3
"""Where the paused set lives in stage_state."""
ALL = "*"
"""The paused set's entry for the whole run."""


def read(store: Store) -> dict[str, Any]:
    """{"paused": [policy names, or "*" for the whole run]} as stored (for `status` and the dashboard)."""
    try:
        rows = store.query(
            "SELECT state FROM stage_state WHERE policy = ? AND stage = ?", (ROW_POLICY, ROW_STAGE)
        )
    except Exception:  # a state file from before this table existed
        return {"paused": []}
    state = json.loads(rows[0]["state"]) if rows else {}
    return {"paused": sorted(str(p) for p in state.get("paused", []))}


def leasable(paused: set[str], feeds: Iterable[str]) -> bool:
    """False for a queued task whose every fed policy is paused: it waits in the queue, leased to no
    worker (the controller's lease rule, and the autoscaler's count of tasks that wait on workers)."""
    if not paused:
        return True
    feeds = list(feeds)
    return not feeds or not (ALL in paused or all(p in paused for p in feeds))

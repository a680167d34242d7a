"""Step rows that metrics.jsonl lacks, derived from state.db after a restart.

A step's metrics row commits to state.db's `metrics` table with the step's version; the sinks get it
just after that commit. A controller killed in between leaves the row in state.db only. On restart the
controller gives the sinks every row newer than the newest one metrics.jsonl holds, so no step's row
is lost for good. Rows are written in commit order, so the missing ones are always the newest: the
search reads metrics.jsonl's tail and state.db from its newest row back to the first one the file has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow.metrics.log import MetricsLog
from astraflow.state.store import Store


def lost_rows(store: Store, jsonl: Path) -> list[dict[str, Any]]:
    """The step rows of state.db that metrics.jsonl lacks, oldest first (eval rows are not derived)."""
    have = {
        (r.get("policy"), r.get("step"))
        for r in MetricsLog(jsonl).load_tail()
        if "kind" not in r  # eval rows share (policy, step) with step rows
    }
    out: list[dict[str, Any]] = []
    for row in store.metrics_rows_newest_first():
        if (row.get("policy"), row.get("step")) in have:
            break
        out.append(row)
    return out[::-1]

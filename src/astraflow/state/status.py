"""The status document (`astraflow status --json`, StatusReply): a stable schema, see docs/status.md."""

from __future__ import annotations

from typing import Any

from astraflow.dataflow import failures
from astraflow.state.store import Store

SCHEMA_VERSION = 1


def build_status(store: Store) -> dict[str, Any]:
    """Policies, members, ledger counts, buffers and run facts, read from the store (reads only)."""
    run = store.run()
    recipe = run["recipe"] if run else {}
    steps = int(recipe.get("run", {}).get("steps", 0)) if recipe else 0
    policies = []
    buffers: dict[str, dict[str, int]] = {}
    for p in store.policies():
        m = store.last_metrics(p["name"]) or {}
        reward = m.get("reward_mean")
        stale = m.get("staleness_max")
        policies.append(
            {
                "name": p["name"],
                "version": int(p["version"]),
                "step": int(p["step"]),
                "reward_mean": None if reward is None else float(reward),
                "max_staleness": int(p["max_staleness"]),
                "staleness_max": None if stale is None else float(stale),
            }
        )
        counts = {"buffered": 0, "consumed": 0, "expired": 0, "dropped": 0}
        for r in store.query(
            "SELECT status, COUNT(*) AS n FROM trajectories WHERE policy = ? GROUP BY status", (p["name"],)
        ):
            counts[r["status"]] = int(r["n"])
        buffers[p["name"]] = counts
    members = [
        {
            "id": m["id"],
            "role": m["role"],
            "status": m["status"],
            "policies": list(m["policies"]),
            "region": m["region"] or "",
            "hardware": m["hardware"] or "",
            "loaded": {k: int(v) for k, v in m["loaded"].items()},
            "slots": int(m["slots"] or 0),
            "last_seen": float(m["last_seen"] or 0.0),
        }
        for m in store.members()
    ]
    tasks = {"queued": 0, "leased": 0, "done": 0, "failed": 0}
    for r in store.query("SELECT status, COUNT(*) AS n FROM tasks GROUP BY status"):
        tasks[r["status"]] = int(r["n"])
    fails = failures.counts(store)
    by_reason = {k: int(v) for k, v in fails.get("by_reason", {}).items()}
    return {
        "schema": SCHEMA_VERSION,
        "run": {"name": run["name"] if run else "", "steps": steps},
        "policies": policies,
        "members": members,
        "tasks": tasks,
        "failures": {"by_reason": by_reason, "last_error": str(fails.get("last_error", ""))[:500]},
        "buffers": buffers,
    }

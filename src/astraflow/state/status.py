"""The status document (`astraflow status --json`, StatusReply): a stable schema, see docs/status.md."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from astraflow.state import failure_counts, paused, trajectories
from astraflow.state import tasks as task_rows
from astraflow.state.archive import archived_counts
from astraflow.state.demand import build_demand
from astraflow.state.store import Store, skipped_steps

SCHEMA_VERSION = 1


def build_status(store: Store, room: dict[str, int] | None = None) -> dict[str, Any]:
    """Policies, members, ledger counts, buffers, demand and run facts, read from the store (reads
    only); `room` is the live admission's room per policy (the controller passes it)."""
    run = store.run()
    recipe = run["recipe"] if run else {}
    steps = int(recipe.get("run", {}).get("steps", 0)) if recipe else 0
    configs = {p.get("name"): p for p in recipe.get("policy", [])} if recipe else {}
    policies = []
    buffers: dict[str, dict[str, int]] = {}
    skipped = skipped_steps(store)
    for p in store.policies():
        m = store.last_metrics(p["name"]) or {}
        reward = m.get("reward_mean")
        stale = m.get("staleness_max")
        cfg = configs.get(p["name"], {})
        trainable = bool(cfg.get("trainable", True))
        budget = (cfg.get("steps") or steps) if trainable else 0
        policies.append(
            {
                "name": p["name"],
                "trainable": trainable,
                "budget": int(budget),
                "finished": trainable and int(p["step"]) >= int(budget),
                "info": {k[5:]: float(v) for k, v in m.items() if k.startswith("info/")},
                "version": int(p["version"]),
                "step": int(p["step"]),
                "reward_mean": None if reward is None else float(reward),
                "max_staleness": int(p["max_staleness"]),
                "staleness_max": None if stale is None else float(stale),
                "eval": _latest_eval(store, p["name"]),
                "skipped_steps": skipped.get(p["name"], []),
            }
        )
        counts = trajectories.status_counts(store, p["name"])
        for status, n in archived_counts(store, p["name"]).items():
            counts[status] = counts.get(status, 0) + n  # trajectories a retention pass moved out
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
            "failures": int(m.get("failures") or 0),
            "invalid": int(m.get("invalid") or 0),
            "expiries": int(m.get("expiries") or 0),
            "quarantined": str(m.get("quarantined") or ""),
        }
        for m in store.members()
    ]
    tasks = task_rows.status_counts(store)
    fails = failure_counts.counts(store)
    by_reason = {k: int(v) for k, v in fails.get("by_reason", {}).items()}
    stall = None
    for ev in reversed(store.events(limit=200)):
        if ev["kind"] in ("stall", "unstalled", "stall_fail"):
            if ev["kind"] != "unstalled":
                stall = {"time": float(ev["time"]), **json.loads(ev["detail"])}
            break
    return {
        "schema": SCHEMA_VERSION,
        "run": {
            "name": run["name"] if run else "",
            "steps": steps,
            "mode": str(recipe.get("run", {}).get("mode", "async")) if recipe else "async",
        },
        "stall": stall,
        "control": paused.read(store),
        "policies": policies,
        "members": members,
        "tasks": tasks,
        "failures": {
            "by_reason": by_reason,
            "last_error": failure_counts.tail(str(fails.get("last_error", "")), 500),
        },
        "buffers": buffers,
        "demand": build_demand(store, room),
    }


def _latest_eval(store: Store, policy: str) -> dict[str, float | int] | None:
    """The newest finished held-out eval round of a policy: version, step and its `eval/` numbers."""
    try:
        v = store.scalar(
            "SELECT metrics FROM eval_rounds WHERE policy = ? AND status = 'done' ORDER BY version DESC LIMIT 1",
            (policy,),
        )
    except sqlite3.OperationalError:
        return None  # a run directory written before eval rounds existed
    if v is None:
        return None
    row = json.loads(v)
    out: dict[str, float | int] = {"version": int(row["version"]), "step": int(row["step"])}
    out.update({k[5:]: float(x) for k, x in row.items() if k.startswith("eval/")})
    return out

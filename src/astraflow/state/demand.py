"""Demand on the rollout pool (`status.demand`): what an autoscaler reads to size the RaaS workers.

Everything here is read from the store, except admission room: only the live controller knows its
admission (staleness caps, the workflow's task shape, replay), so `room` is filled in by the
controller's StatusReply and is null in a status read from the run directory.
"""

from __future__ import annotations

import json
from typing import Any

from astraflow.state.paused import leasable, read
from astraflow.state.store import Store

PACE_STEPS = 5
"""Newest metrics rows per policy the pace is measured over."""


def build_demand(store: Store, room: dict[str, int] | None = None) -> dict[str, Any]:
    """Queued and leased training tasks (and the queued ones a worker could lease: `waiting`), the
    alive RaaS workers' slots and leases, idle fraction, admission room and steps per minute of each
    policy."""
    queued = int(store.scalar("SELECT COUNT(*) FROM tasks WHERE status = 'queued'") or 0)
    leased_by: dict[str, int] = {
        str(r["owner"]): int(r["n"])
        for r in store.query("SELECT owner, COUNT(*) AS n FROM tasks WHERE status = 'leased' GROUP BY owner")
    }
    workers = []
    for m in store.members("alive"):
        if m["role"] != "raas":
            continue
        workers.append(
            {
                "id": m["id"],
                "slots": int(m["slots"] or 0),
                "leased": leased_by.get(m["id"], 0),
                "quarantined": bool(m.get("quarantined")),
            }
        )
    slots = sum(w["slots"] for w in workers)
    busy = sum(min(w["leased"], w["slots"]) for w in workers)
    return {
        "queued": queued,
        "waiting": waiting(store, queued),
        "leased": sum(leased_by.values()),
        "raas": len(workers),
        "slots": slots,
        "busy_slots": busy,
        "idle_fraction": None if slots == 0 else round(1.0 - busy / slots, 4),
        "workers": workers,
        "room": room,
        "pace": {p["name"]: steps_per_minute(store, p["name"]) for p in store.policies()},
    }


def waiting(store: Store, queued: int) -> int:
    """Queued tasks that wait on a worker: those feeding a policy whose admission is not paused (a
    task feeding only paused policies is leased to no worker, dataflow/control.py, so more workers
    would not take it)."""
    paused = set(read(store)["paused"])
    if not paused or not queued:
        return queued
    n = 0
    for r in store.query("SELECT * FROM tasks WHERE status = 'queued'"):
        read_only = set(json.loads(r["read_only"] or "[]")) if "read_only" in r.keys() else set()
        n += leasable(paused, [p for p in json.loads(r["roles"]).values() if p not in read_only])
    return n


def steps_per_minute(store: Store, policy: str) -> float | None:
    """The policy's optimizer steps per minute over its newest PACE_STEPS metrics rows (None before
    two rows exist)."""
    rows = store.query(
        "SELECT step, time FROM metrics WHERE policy = ? ORDER BY id DESC LIMIT ?", (policy, PACE_STEPS)
    )
    if len(rows) < 2:
        return None
    t1, s1 = float(rows[0]["time"]), float(rows[0]["step"])
    t0, s0 = float(rows[-1]["time"]), float(rows[-1]["step"])
    if t1 <= t0:
        return None
    return round((s1 - s0) / (t1 - t0) * 60.0, 3)

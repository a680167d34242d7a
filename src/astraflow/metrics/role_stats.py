"""A RaaS worker's own counters over time: engine busy time and weight pulls, for `astraflow bench e2e`.

`astraflow up` gives each local RaaS the path logs/raas-<i>.stats.jsonl in the variable STATS_ENV; a
worker with it set appends one JSON line of cumulative counters every INTERVAL_S seconds and a last one
when it stops. Workers joined by hand write nothing unless the variable is set. The lines carry no
secret: times, counts and versions.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from astraflow import log

_log = log.get("stats")

STATS_ENV = "ASTRAFLOW_STATS_FILE"
"""Variable naming the file a RaaS appends its counters to."""
INTERVAL_S = 0.5
"""Seconds between two lines."""
RECENT = 256
"""Pulls a line lists one by one (per policy), beside the cumulative counters."""


class PullStats:
    """Per policy, cumulative time a worker spent getting new weights ready before its engine applies them."""

    def __init__(self) -> None:
        self.by_policy: dict[str, dict[str, float]] = {}
        """policy -> pulls, fetch_s (transfer from the trainer's weight server with the digest check),
        load_s (bytes to tensors, the engine's shape check and staging), bytes."""
        self.ways: dict[str, int] = {}
        """Pulls by way (weights/fetch.py HeldWeights.counts: full, delta, held, relay, fallback)."""
        self.recent: dict[str, deque[tuple[float, float, float, int]]] = {}
        """policy -> the last RECENT pulls as (wall time it was staged, fetch_s, load_s, bytes): a reader
        counts the pulls inside a time window from one line, however seldom lines were written."""

    def add(self, policy: str, fetch_s: float, load_s: float, nbytes: int) -> None:
        """One version of `policy` pulled and staged."""
        c = self.by_policy.setdefault(policy, {"pulls": 0, "fetch_s": 0.0, "load_s": 0.0, "bytes": 0})
        c["pulls"] += 1
        c["fetch_s"] += fetch_s
        c["load_s"] += load_s
        c["bytes"] += nbytes
        self.recent.setdefault(policy, deque(maxlen=RECENT)).append((time.time(), fetch_s, load_s, nbytes))

    def of(self, policy: str) -> dict[str, Any]:
        """One policy's counters as plain numbers, with its recent pulls under "recent"."""
        out: dict[str, Any] = dict(self.by_policy.get(policy, {}))
        if policy in self.recent:
            out["recent"] = [list(x) for x in self.recent[policy]]
        return out


class StatsWriter:
    """Appends a worker's counters to the file named by STATS_ENV (a no-op when it is unset)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = Path(path) if path else (Path(p) if (p := os.environ.get(STATS_ENV)) else None)
        self.last = 0.0

    def maybe_write(self, snapshot: dict[str, Any], force: bool = False) -> None:
        """Append one line if INTERVAL_S passed since the last (or when forced); never raises."""
        if self.path is None:
            return
        now = time.time()
        if not force and now - self.last < INTERVAL_S:
            return
        self.last = now
        try:
            with self.path.open("a") as f:
                f.write(json.dumps({"time": now, **snapshot}) + "\n")
        except OSError as exc:
            _log.warning("cannot write stats to %s (%s); not trying again", self.path, exc)
            self.path = None


def raas_snapshot(
    member_id: str, started: float, engines: dict[str, Any], pulls: PullStats
) -> dict[str, Any]:
    """One line of a worker's counters: each engine's stats() where it has them, and its weight pulls."""
    per: dict[str, Any] = {}
    for name, eng in engines.items():
        stats = getattr(eng, "stats", None)
        per[name] = {"version": eng.version, **(stats() if callable(stats) else {})}
        per[name]["pulls"] = pulls.of(name)
    return {"member": member_id, "started": started, "engines": per, "weight_pulls": dict(pulls.ways)}


def read_stats(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a stats file (a torn last line is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

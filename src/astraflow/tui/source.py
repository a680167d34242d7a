"""Where the dashboard's numbers come from: a run directory (state.db read-only, metrics.jsonl, logs)
or a live controller's status document. No Textual here, so it is tested and timed on its own."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.metrics.log import MetricsLog
from astraflow.state.views import Sample


@dataclass
class Snapshot:
    """Everything one poll read; the app renders it."""

    run_name: str = ""
    steps: int = 0
    policies: list[dict[str, Any]] = field(default_factory=list)
    members: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, dict[str, int]] = field(default_factory=dict)
    staleness: dict[str, dict[int, int]] = field(default_factory=dict)
    new_rows: list[dict[str, Any]] = field(default_factory=list)
    new_events: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    """Policies whose admission is paused ("*": the whole run)."""
    error: str = ""
    taken: float = 0.0


def _members(
    doc: dict[str, Any], done: dict[str, int], hosts: dict[str, str], now: float
) -> list[dict[str, Any]]:
    out = []
    for m in doc.get("members", []):
        out.append(
            {
                **m,
                "tasks_done": done.get(m["id"]),
                "host": hosts.get(m["id"], ""),
                "age_s": max(0.0, now - m["last_seen"]),
            }
        )
    return out


class RunDirSource:
    """Polls a run directory: state.db through a read-only connection with a short busy timeout, and
    only the bytes appended to metrics.jsonl since the last poll."""

    kind = "run-dir"

    def __init__(self, run_dir: Path) -> None:
        from astraflow.errors import AstraflowError

        self.run_dir = run_dir
        if not (run_dir / "state.db").is_file():
            raise AstraflowError(
                f"no state.db in {run_dir}", hint="pass the run directory of a run (runs/<name>-<time>/)"
            )
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.first = True
        self.last_event = 0
        self._store: Any = None
        self.lock = threading.Lock()
        self.recipe: dict[str, Any] = {}
        resolved = run_dir / "recipe.resolved.json"
        if resolved.is_file():
            self.recipe = json.loads(resolved.read_text())

    def store(self) -> Any:
        """The read-only connection (opened on first use)."""
        if self._store is None:
            from astraflow.state.views import open_for_reading

            self._store = open_for_reading(self.run_dir / "state.db")
        return self._store

    def poll(self) -> Snapshot:
        """Read what changed; a busy database yields a snapshot with `error` set, never a wait."""
        import sqlite3

        snap = Snapshot(taken=time.time())
        with self.lock:
            snap.new_rows = self.metrics.load_tail() if self.first else self.metrics.read_new()
            self.first = False
            try:
                doc = self._read(snap)
            except sqlite3.OperationalError as exc:  # locked or mid-checkpoint: skip this poll
                snap.error = f"state.db busy ({exc}); showing the previous poll"
                return snap
        snap.run_name, snap.steps = doc["run"]["name"], doc["run"]["steps"]
        snap.policies, snap.tasks, snap.buffers = doc["policies"], doc["tasks"], doc["buffers"]
        snap.paused = list(doc.get("control", {}).get("paused", []))
        return snap

    def _read(self, snap: Snapshot) -> dict[str, Any]:
        """The status document, with members, staleness, new events and failed tasks put in `snap`."""
        from astraflow.state import views
        from astraflow.state.status import build_status

        st = self.store()
        doc = build_status(st)
        snap.members = _members(doc, views.tasks_done_by_member(st), views.member_hosts(st), snap.taken)
        snap.staleness = {p["name"]: views.staleness_histogram(st, p["name"]) for p in doc["policies"]}
        snap.new_events = views.events_since(st, self.last_event)
        if snap.new_events:
            self.last_event = int(snap.new_events[-1]["id"])
        snap.failed = views.failed_tasks(st)
        return doc

    def history(self) -> list[dict[str, Any]]:
        """Metrics rows older than the first poll's tail (read once, in the background)."""
        with self.lock:
            return self.metrics.read_history()

    def samples(self, policy: str, limit: int = 50) -> list[Sample]:
        """The newest trajectories of a policy."""
        from astraflow.state.views import recent_samples

        with self.lock:
            return recent_samples(self.store(), policy, limit)

    def model_dir(self, policy: str) -> str:
        """The policy's model directory from the resolved recipe ("" when unknown)."""
        for p in self.recipe.get("policy", []):
            if p.get("name") == policy:
                return str(p.get("model", ""))
        return ""

    def close(self) -> None:
        """Close the database connection."""
        if self._store is not None:
            self._store.close()
            self._store = None


class ControllerSource:
    """Polls a live controller with StatusRequest (about once a second). The status document has no
    metric history, events or trajectories: curves start when the dashboard does, from the reward
    each poll reports; the rest needs --run-dir on the controller's machine."""

    kind = "controller"

    def __init__(self, address: str, timeout_s: float = 2.0, credentials: Any = None) -> None:
        self.address = address
        self.credentials = credentials
        """security.MemberCredentials for an authenticated controller (an observer or operator key)."""
        self.timeout_s = timeout_s
        self.seen: dict[str, int] = {}

    def poll(self) -> Snapshot:
        """Ask the controller for its status; an unreachable controller sets `error`."""
        from astraflow.errors import AstraflowError
        from astraflow.transport.control_client import ask_status

        snap = Snapshot(taken=time.time())
        try:
            doc = ask_status(self.address, self.timeout_s, credentials=self.credentials)
        except AstraflowError as exc:
            snap.error = exc.message
            return snap
        snap.run_name, snap.steps = doc["run"]["name"], doc["run"]["steps"]
        snap.policies, snap.tasks, snap.buffers = doc["policies"], doc["tasks"], doc["buffers"]
        snap.paused = list(doc.get("control", {}).get("paused", []))
        snap.members = _members(doc, {}, {}, snap.taken)
        for p in doc["policies"]:
            if p["step"] > self.seen.get(p["name"], 0) and p.get("reward_mean") is not None:
                self.seen[p["name"]] = p["step"]
                snap.new_rows.append(
                    {
                        "policy": p["name"],
                        "step": p["step"],
                        "version": p["version"],
                        "time": snap.taken,
                        "reward_mean": p["reward_mean"],
                        "staleness_max": p.get("staleness_max") or 0.0,
                    }
                )
        return snap

    def history(self) -> list[dict[str, Any]]:
        """No history over the wire."""
        return []

    def samples(self, policy: str, limit: int = 50) -> list[Sample]:
        """Trajectories are not on the wire."""
        return []

    def model_dir(self, policy: str) -> str:
        """Unknown over the wire."""
        return ""

    def close(self) -> None:
        """Nothing held between polls."""


Source = RunDirSource | ControllerSource
"""Either kind of source."""

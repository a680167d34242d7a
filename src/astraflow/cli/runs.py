"""`astraflow runs`: the run directories under a folder with their status, steps and final rewards."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from astraflow.errors import AstraflowError

LIVE_WITHIN_S = 30.0
"""A run whose state changed this recently, and is not finished, counts as running."""


def describe(run_dir: Path) -> dict[str, Any]:
    """One run's summary: name, status, steps per policy, final reward per policy, last update."""
    from astraflow.metrics.log import MetricsLog
    from astraflow.state.status import build_status
    from astraflow.state.views import last_update, open_for_reading

    store = open_for_reading(run_dir / "state.db", busy_timeout_s=1.0)
    try:
        doc = build_status(store)
        updated = last_update(store)
    finally:
        store.close()
    budget = int(doc["run"]["steps"])
    pols = doc["policies"]
    # each trainable policy against its own budget (policy.steps, else run.steps); frozen ones have none
    finished = bool(pols) and all(
        p.get("finished", p["step"] >= budget) for p in pols if p.get("trainable", True)
    )
    failed = int(doc["tasks"].get("failed", 0))
    if finished:
        status = "finished"
    elif time.time() - updated < LIVE_WITHIN_S:
        status = "running"
    else:
        status = "stopped"
    # the last 1 MB of metrics.jsonl holds each policy's final rows
    last: dict[str, dict[str, Any]] = {}
    for row in MetricsLog(run_dir / "metrics.jsonl").load_tail():
        if "kind" not in row:  # held-out eval rows carry no training reward, late rows no reward
            last[str(row.get("policy"))] = row
    return {
        "run_dir": str(run_dir),
        "name": doc["run"]["name"],
        "status": status,
        "steps": budget,
        "policies": {
            p["name"]: {
                "step": p["step"],
                "reward_mean": last.get(p["name"], {}).get("reward_mean", p["reward_mean"]),
            }
            for p in pols
        },
        "failed_tasks": failed,
        "updated": updated,
    }


def _described(run_dir: Path) -> dict[str, Any]:
    """describe(), or an `unreadable` row for a run whose state.db cannot be read (one bad run directory
    does not hide the others)."""
    import sqlite3

    try:
        return describe(run_dir)
    except sqlite3.DatabaseError:
        return {
            "run_dir": str(run_dir),
            "name": "",
            "status": "unreadable",
            "steps": 0,
            "policies": {},
            "failed_tasks": 0,
            "updated": 0.0,
        }


def find_runs(root: Path) -> list[Path]:
    """Run directories (those holding a state.db) directly under root, or root itself."""
    if (root / "state.db").is_file():
        return [root]
    return sorted(p.parent for p in root.glob("*/state.db"))


def runs(
    root: Annotated[Path, typer.Argument(help="Folder of run directories.")] = Path("runs"),
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List run directories with their status (running, finished, stopped), steps and final rewards."""
    if not root.is_dir():
        raise AstraflowError(f"no folder {root}", hint="runs are under runs/ by default; pass another folder")
    rows = [_described(p) for p in find_runs(root)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not rows:
        typer.echo(f"no run directories under {root}")
        return
    for r in rows:
        pols = "  ".join(
            f"{name} {p['step']}/{r['steps']} reward "
            + ("-" if p["reward_mean"] is None else f"{p['reward_mean']:.3f}")
            for name, p in r["policies"].items()
        )
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated"])) if r["updated"] else "-"
        fail = f"  failed tasks {r['failed_tasks']}" if r["failed_tasks"] else ""
        typer.echo(f"{r['run_dir']}  {r['status']:<8}  {when}  {pols}{fail}")

"""The pipeline benchmark: one recipe in sync mode (the baseline) and in async mode, side by side.

Both runs go through `astraflow up` in their own run directories (`--set run.mode=...`), one after the
other, and are read back from metrics.jsonl and state.db. Per policy: steps, wall time per step in
the steady state (from its first step to its last, so process start-up is left out), the trainer's idle
fraction (time waiting for a batch over waiting + stepping, first step excluded), and the staleness of
its batches. Per run: the RaaS slots' idle fraction (1 - leased task time / (workers x slots x the
time from the first lease to the last result)) and the throughput, all steps of all policies per second
between the first and the last step of the run. The ratio is async / sync throughput, and per policy
sync / async time per step.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from astraflow.state.store import StateError, Store
from astraflow.state.tasks import done_lease_span

MODES = ("sync", "async")
"""Baseline first."""


@dataclass
class PolicyPace:
    """One policy's pace in one run."""

    steps: int = 0
    """Steps it took."""
    s_per_step: float | None = None
    """Wall seconds per step from its first step to its last (None with fewer than two steps)."""
    trainer_idle: float | None = None
    """Share of its trainer's time spent waiting for a batch (steps after the first)."""
    staleness_mean: float = 0.0
    """Mean staleness of its batches' samples."""
    staleness_max: float = 0.0
    """Largest staleness of any sample it trained on."""


@dataclass
class ModeResult:
    """One run of the recipe in one mode."""

    mode: str
    run_dir: str
    ok: bool = False
    error: str = ""
    wall_s: float = 0.0
    """Wall time of the whole `astraflow up`, start-up included."""
    steps_per_s: float | None = None
    """All policies' steps per second between the run's first and last step."""
    raas_idle: float | None = None
    """Share of RaaS slot time with no task leased, from the first lease to the last result."""
    policies: dict[str, PolicyPace] = field(default_factory=dict)


def read_pace(run_dir: Path, res: ModeResult, workers: int, slots: int) -> None:
    """Fill `res` from a finished run directory."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "kind" not in rec:  # held-out eval rows and late rows are not trainer steps
                rows.setdefault(str(rec["policy"]), []).append(rec)
    times: list[float] = []
    for pol, recs in rows.items():
        recs.sort(key=lambda r: r["step"])
        ts = [float(r["time"]) for r in recs]
        times += ts
        wait = sum(float(r.get("trainer_wait_s", 0.0)) for r in recs[1:])
        busy = sum(float(r.get("trainer_step_s", 0.0)) for r in recs[1:])
        res.policies[pol] = PolicyPace(
            steps=len(recs),
            s_per_step=(ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None,
            trainer_idle=wait / (wait + busy) if wait + busy > 0 else None,
            staleness_mean=sum(float(r.get("staleness_mean", 0.0)) for r in recs) / len(recs),
            staleness_max=max(float(r.get("staleness_max", 0.0)) for r in recs),
        )
    if len(times) > 1 and max(times) > min(times):
        res.steps_per_s = (len(times) - 1) / (max(times) - min(times))
    store = Store.open_readonly(run_dir / "state.db")
    try:
        span = done_lease_span(store)
    finally:
        store.close()
    if span is not None and span[1] > span[0] and workers * slots > 0:
        first, last, busy = span
        res.raas_idle = max(0.0, 1.0 - busy / (workers * slots * (last - first)))


def run_mode(
    recipe: Path, mode: str, run_dir: Path, overrides: list[str], timeout_s: float, workers: int, slots: int
) -> ModeResult:
    """Run the recipe in one mode through `astraflow up` and read its pace back (failures are recorded)."""
    from astraflow.bench.data import run_recipe

    raw = run_recipe(recipe, mode, run_dir, [*overrides, f'run.mode="{mode}"'], timeout_s)
    res = ModeResult(mode=mode, run_dir=str(run_dir), ok=raw.ok, error=raw.error, wall_s=raw.wall_s)
    if res.ok:
        try:
            read_pace(run_dir, res, workers, slots)
        except (OSError, sqlite3.Error, StateError, ValueError, KeyError) as exc:
            res.ok, res.error = False, f"could not read the run back: {exc}"
    return res


def compare(results: list[ModeResult]) -> dict[str, Any]:
    """The results and the async/sync ratios (throughput, and per policy time per step)."""
    by = {r.mode: r for r in results}
    out: dict[str, Any] = {"runs": [asdict(r) for r in results]}
    s, a = by.get("sync"), by.get("async")
    if s and a and s.ok and a.ok and s.steps_per_s and a.steps_per_s:
        out["throughput_ratio"] = a.steps_per_s / s.steps_per_s
        speed: dict[str, float] = {}
        for p, pace in a.policies.items():
            base = s.policies.get(p)
            if base is not None and base.s_per_step and pace.s_per_step:
                speed[p] = base.s_per_step / pace.s_per_step
        out["per_policy_speedup"] = speed
    return out


def add_steady(summary: dict[str, Any]) -> None:
    """With both runs' end-to-end reports (`summary["e2e"]`, bench/e2e.py), the ratio of their
    steady windows' generated samples a second, async / sync: the pace once both are running, where
    `throughput_ratio` also counts how each run got there (its first steps)."""
    rates = {
        mode: float((summary.get("e2e", {}).get(mode) or {}).get("generated_per_s") or 0.0) for mode in MODES
    }
    if all(rates.values()):
        summary["steady_samples"] = rates
        summary["steady_samples_ratio"] = rates["async"] / rates["sync"]


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table of both runs and the ratios."""

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"{'mode':<6} {'policy':<12} {'steps':>5} {'s/step':>7} {'trainer idle':>12} {'staleness':>11}",
    ]
    for run in summary["runs"]:
        if not run["ok"]:
            lines.append(f"{run['mode']:<6} FAILED: {run['error']}")
            continue
        for name, p in run["policies"].items():
            lines.append(
                f"{run['mode']:<6} {name:<12} {p['steps']:>5} {f(p['s_per_step'], '.2f'):>7} "
                f"{f(p['trainer_idle'], '.0%'):>12} {p['staleness_mean']:>6.2f}/{p['staleness_max']:<4.0f}"
            )
        lines.append(
            f"{run['mode']:<6} {'(run)':<12} steps/s {f(run['steps_per_s'], '.2f')}, RaaS idle "
            f"{f(run['raas_idle'], '.0%')}, wall {run['wall_s']:.0f}s"
        )
    if "throughput_ratio" in summary:
        per = ", ".join(f"{k} {v:.2f}x" for k, v in summary["per_policy_speedup"].items())
        lines.append(f"async / sync throughput: {summary['throughput_ratio']:.2f}x  (time per step: {per})")
    if "steady_samples_ratio" in summary:
        rates = summary["steady_samples"]
        lines.append(
            f"steady windows, samples/s generated: sync {rates['sync']:.1f}, async {rates['async']:.1f}: "
            f"{summary['steady_samples_ratio']:.2f}x"
        )
    return "\n".join(lines)

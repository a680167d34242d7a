"""The data-efficiency benchmark: run recipes that differ in their data stages, then compare them.

Each recipe runs through `astraflow up` as a child process in its own run directory, one after the
other. Afterwards each run is read back from its metrics.jsonl and state.db (read-only): how many
rollouts it generated, trained on (fresh and replayed), filtered and let expire, and its reward curve.

The reward curve is measured on the rollouts, not on the trained batches: a filter such as dynamic
sampling removes all-solved and all-failed groups from the batches, so their mean reward says little
about the policy. Point v of the curve is the mean reward of every trajectory generated with weights
of version v (its oldest token's version), whatever happened to it afterwards. A curator that skips
prompts (GRESO) still biases it, since skipped prompts produce no rollouts at all.

Over 400 lines because one benchmark's runner, its readers of finished runs and its tables share
the RunResult they pass along; each function is small.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.state import trajectories
from astraflow.state.batches import replayed_count
from astraflow.state.store import Store

_log = log.get("bench.data")


@dataclass
class RunResult:
    """What one recipe's run produced, read back from its run directory."""

    name: str
    """Variant label: the recipe file's stem."""
    recipe: str
    """Recipe path as given."""
    run_dir: str
    """The run directory `astraflow up` wrote."""
    seed: int | None = None
    """The run.seed it ran with when --seeds was given (None: the recipe's own)."""
    ok: bool = False
    """Whether `astraflow up` exited 0."""
    error: str = ""
    """Why the run failed ('' when it did not)."""
    wall_s: float = 0.0
    """Wall time of the whole `astraflow up`, start-up included."""
    policy: str = ""
    """The policy measured (the recipe's first)."""
    steps: int = 0
    """Optimizer steps the policy took."""
    batch_size: int = 0
    """Sequences per step (batch_prompts * group_size)."""
    generated: int = 0
    """Trajectories produced by the rollout workers."""
    trained_fresh: int = 0
    """Trajectories consumed by a step for the first time."""
    replayed: int = 0
    """Batch slots filled by replaying an already consumed trajectory."""
    filtered: int = 0
    """Trajectories dropped by a post-rollout filter."""
    expired: int = 0
    """Trajectories that went too stale to train on."""
    skipped_prompts: int = 0
    """Prompts a curator declined to submit (no rollouts spent on them)."""
    reward_start: float | None = None
    """Mean rollout reward over the first tenth of versions."""
    reward_final: float | None = None
    """Mean rollout reward over the last tenth of versions (the reward reached)."""
    batch_reward_final: float | None = None
    """Mean reward of the trained batches over the last tenth of steps (biased by filters)."""
    mixed_start: float | None = None
    """Share of groups with unequal rewards (they carry gradient) over the first tenth of versions."""
    mixed_end: float | None = None
    """Share of groups with unequal rewards over the last tenth of versions."""
    curve: list[tuple[int, float, int]] = field(default_factory=list)
    """Per weight version: (version, mean rollout reward, rollouts generated up to that version)."""
    stages: dict[str, float] = field(default_factory=dict)
    """The data stages' counters at the last step (metrics keys starting with data/)."""

    @property
    def trained(self) -> int:
        """Batch slots trained on: fresh plus replayed."""
        return self.trained_fresh + self.replayed


def run_names(paths: list[Path]) -> list[str]:
    """A unique label per recipe: its stem, with -2, -3 ... on repeats."""
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        n = seen.get(p.stem, 0) + 1
        seen[p.stem] = n
        out.append(p.stem if n == 1 else f"{p.stem}-{n}")
    return out


def parse_seeds(text: str) -> list[int]:
    """The seeds of `--seeds 0,1,2`: distinct integers, in the order given."""
    from astraflow.errors import AstraflowError

    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise AstraflowError(f"bad --seeds {text!r}", hint="give distinct integers, e.g. --seeds 0,1,2")
    return seeds


def run_recipe(
    path: Path,
    name: str,
    run_dir: Path,
    overrides: list[str],
    timeout_s: float,
    seed: int | None = None,
) -> RunResult:
    """Run one recipe through `astraflow up` and read its results back; a failure is recorded, not raised."""
    from astraflow.launch.supervisor import astraflow_cmd

    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*astraflow_cmd(), "up", str(path), "--run-dir", str(run_dir), "--no-dash"]
    # The seed goes last so that it wins over a run.seed in the shared overrides.
    for item in [*overrides, *([] if seed is None else [f"run.seed={seed}"])]:
        cmd += ["--set", item]
    res = RunResult(name=name, recipe=str(path), run_dir=str(run_dir), seed=seed)
    log_path = run_dir / "up.log"
    t0 = time.monotonic()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM lets `up` stop its own children in order; SIGKILL only if it does not.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = None
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    res.wall_s = time.monotonic() - t0
    if rc is None:
        res.error = f"timed out after {timeout_s:.0f}s (see {log_path})"
    elif rc != 0:
        res.error = f"exit {rc}: {failure_reason(log_path)} (see {log_path})"
    res.ok = rc == 0
    try:
        read_run(run_dir, res)
    except (OSError, sqlite3.Error, ValueError, KeyError) as exc:
        if res.ok:
            res.ok = False
            res.error = f"could not read the run back: {exc}"
    return res


def failure_reason(log_path: Path) -> str:
    """The most telling line of a failed run's output: its last 'error:' line, else its last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    for ln in reversed(lines):
        if ln.startswith("error:") or " E " in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def read_run(run_dir: Path, res: RunResult) -> RunResult:
    """Fill `res` from the run directory: resolved recipe, metrics.jsonl and state.db (read-only)."""
    resolved = json.loads((run_dir / "recipe.resolved.json").read_text())
    pol = resolved["policy"][0]
    res.policy = str(pol["name"])
    res.batch_size = int(pol["batch_prompts"]) * int(pol["group_size"])
    rows = read_metrics(run_dir / "metrics.jsonl", res.policy)
    res.steps = max((int(r["step"]) for r in rows), default=0)
    if rows:
        last = rows[-1]
        res.stages = {
            k: float(v) for k, v in last.items() if k.startswith("data/") and isinstance(v, int | float)
        }
        res.skipped_prompts = int(res.stages.get("data/prompts_skipped", 0))
        res.batch_reward_final = tail_mean([float(r.get("reward_mean", 0.0)) for r in rows])
    db_path = run_dir / "state.db"
    if not db_path.is_file():
        return res
    store = Store.open_readonly(db_path)
    try:
        counts = trajectories.status_counts(store, res.policy)
        res.generated = sum(int(v) for v in counts.values())
        res.trained_fresh = int(counts.get("consumed", 0))
        res.filtered = int(counts.get("dropped", 0))
        res.expired = int(counts.get("expired", 0))
        res.replayed = replayed_count(store, res.policy)
        res.curve = rollout_curve(store, res.policy)
        mixed = mixed_curve(store, res.policy)
    finally:
        store.close()
    rewards = [r for _, r, _ in res.curve]
    res.reward_start = head_mean(rewards)
    res.reward_final = tail_mean(rewards)
    res.mixed_start = head_mean(mixed)
    res.mixed_end = tail_mean(mixed)
    return res


def read_metrics(path: Path, policy: str) -> list[dict[str, Any]]:
    """The metrics.jsonl rows of one policy, in step order (a torn last line is skipped)."""
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("policy") == policy and "step" in rec and rec.get("kind") != "eval":
            rows.append(rec)
    return sorted(rows, key=lambda r: int(r["step"]))


def rollout_curve(store: Store, policy: str) -> list[tuple[int, float, int]]:
    """(version, mean reward, cumulative rollouts) per weight version that generated anything."""
    out = []
    total = 0
    for v, mean, n in trajectories.reward_by_version(store, policy):
        total += n
        if v >= 0:
            out.append((v, mean, total))
    return out


def mixed_curve(store: Store, policy: str, tol: float = 1e-9) -> list[float]:
    """Per weight version (of a group's oldest token), the share of finished groups whose rewards differ."""
    return [m for _, m in trajectories.mixed_by_version(store, policy, tol)]


def head_mean(values: list[float]) -> float | None:
    """Mean of the first tenth (at least one value)."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k


def tail_mean(values: list[float]) -> float | None:
    """Mean of the last tenth (at least one value)."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return sum(values[-k:]) / k


def first_reaching(curve: list[tuple[int, float, int]], target: float, window: int) -> tuple[int, int] | None:
    """(version, rollouts so far) where the rolling mean of `window` curve points first reaches `target`."""
    w = max(1, min(window, len(curve)))
    for i in range(w - 1, len(curve)):
        if sum(r for _, r, _ in curve[i - w + 1 : i + 1]) / w >= target:
            return curve[i][0], curve[i][2]
    return None


def variant_names(results: list[RunResult]) -> list[str]:
    """The variant labels in first-seen order (the first is the baseline)."""
    return list(dict.fromkeys(r.name for r in results))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def choose_target(results: list[RunResult], fixed: float | None, frac: float) -> float | None:
    """The reward target: `fixed`, else `frac` of the way from the baseline's start to the best final reward.

    Both ends are means over a variant's seeds: the baseline is the first variant with a finished run,
    the best final reward is the highest variant mean.
    """
    if fixed is not None:
        return fixed
    ok = [r for r in results if r.ok and r.reward_start is not None and r.reward_final is not None]
    if not ok:
        return None
    names = variant_names(ok)
    start = _mean([float(r.reward_start or 0.0) for r in ok if r.name == names[0]]) or 0.0
    best = max(_mean([float(r.reward_final or 0.0) for r in ok if r.name == n]) or 0.0 for n in names)
    return start + frac * (best - start)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


RATIO_KEYS = ("generated", "trained_fresh", "rollouts_to_target", "step_to_target", "wall_s")
"""Columns reported as a ratio to the baseline."""
AGG_KEYS = (
    "steps",
    "generated",
    "trained_fresh",
    "replayed",
    "filtered",
    "expired",
    "skipped_prompts",
    "reward_start",
    "reward_final",
    "mixed_start",
    "mixed_end",
    "step_to_target",
    "rollouts_to_target",
    "wall_s",
)
"""Columns aggregated over seeds (mean, min, max over the finished runs that have a value)."""


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant, the mean/min/max over its finished runs of every AGG_KEYS column, and mean ratios."""
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(r["name"] for r in rows):
        runs = [r for r in rows if r["name"] == name]
        ok = [r for r in runs if r["ok"]]
        agg: dict[str, Any] = {"name": name, "seeds": [r["seed"] for r in runs]}
        agg.update(ok=len(ok), n=len(runs))
        for k in AGG_KEYS:
            vals = [float(r[k]) for r in ok if r[k] is not None]
            agg[k] = {"mean": _mean(vals), "min": min(vals, default=None), "max": max(vals, default=None)}
            agg[k]["n"] = len(vals)
        out.append(agg)
    base = out[0] if out and out[0]["ok"] else None
    for agg in out:
        agg["ratios"] = {
            k: (_ratio(agg[k]["mean"], base[k]["mean"]) if base is not None and agg["ok"] else None)
            for k in RATIO_KEYS
        }
    return out


def summarize(
    results: list[RunResult], *, target: float | None = None, target_frac: float = 0.5, window: int = 10
) -> dict[str, Any]:
    """The comparison as plain data (what --json prints): every run, and per variant its seed aggregate.

    A run's ratios are against the baseline's run with the same seed; a variant's against the
    baseline's means.
    """
    tgt = choose_target(results, target, target_frac)
    rows: list[dict[str, Any]] = []
    for r in results:
        row = asdict(r)
        row["trained"] = r.trained
        hit = first_reaching(r.curve, tgt, window) if (tgt is not None and r.ok) else None
        row["step_to_target"] = hit[0] if hit else None
        row["rollouts_to_target"] = hit[1] if hit else None
        rows.append(row)
    baseline = results[0].name if results else None
    base_by_seed = {row["seed"]: row for row in rows if row["name"] == baseline and row["ok"]}
    for row in rows:
        base = base_by_seed.get(row["seed"])
        row["ratios"] = {
            k: (_ratio(row[k], base[k]) if base is not None and row["ok"] else None) for k in RATIO_KEYS
        }
    rule = (
        f"fixed {target}"
        if target is not None
        else f"{target_frac} of the way from the baseline's start to the best final reward"
    )
    return {
        "baseline": baseline,
        "seeds": list(dict.fromkeys(r.seed for r in results)),
        "target": tgt,
        "target_rule": rule,
        "window": window,
        "runs": rows,
        "variants": aggregate(rows),
    }


def _num(v: Any, fmt: str = "d") -> str:
    return "-" if v is None else format(v, fmt)


def _with_ratio(v: Any, ratio: float | None, fmt: str = "d") -> str:
    return _num(v, fmt) + ("" if ratio is None else f" (x{ratio:.2f})")


def format_table(summary: dict[str, Any]) -> str:
    """The side-by-side table: one row per recipe, ratios against the first in parentheses."""
    head = [
        "variant",
        "steps",
        "rollouts gen",
        "trained (fresh+replay)",
        "filtered",
        "expired",
        "skipped prompts",
        "reward start->end",
        "step@target",
        "rollouts@target",
        "wall s",
    ]
    table = [head]
    failures = []
    for row in summary["runs"]:
        ra = row["ratios"]
        name = row["name"]
        if not row["ok"]:
            # What a failed run did before it stopped is still worth seeing (e.g. a starved filter).
            name += " (failed)"
            failures.append(f"  {row['name']}: {row['error']}")
        reward = f"{_num(row['reward_start'], '.3f')}->{_num(row['reward_final'], '.3f')}"
        table.append(
            [
                name,
                str(row["steps"]),
                _with_ratio(row["generated"], ra["generated"]),
                f"{row['trained']} ({row['trained_fresh']}+{row['replayed']})",
                str(row["filtered"]),
                str(row["expired"]),
                str(row["skipped_prompts"]),
                reward,
                _with_ratio(row["step_to_target"], ra["step_to_target"]),
                _with_ratio(row["rollouts_to_target"], ra["rollouts_to_target"]),
                _with_ratio(row["wall_s"], ra["wall_s"], ".0f"),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tgt = summary["target"]
    lines.append("")
    lines.append(
        f"baseline: {summary['baseline']}; target reward {_num(tgt, '.3f')} ({summary['target_rule']}), "
        f"reached when a rolling mean over {summary['window']} versions of the rollout reward gets there"
    )
    if failures:
        lines.append("failed runs:")
        lines.extend(failures)
    return "\n".join(lines)


def _stat(agg: dict[str, Any], fmt: str) -> str:
    """'mean [min-max]', or '-' when no finished run has the value."""
    if agg["mean"] is None:
        return "-"
    if agg["min"] == agg["max"]:
        return format(agg["mean"], fmt)
    return f"{agg['mean']:{fmt}} [{agg['min']:{fmt}}-{agg['max']:{fmt}}]"


def format_seed_table(summary: dict[str, Any]) -> str:
    """One row per variant: means over its seeds with [min-max], ratios of the means to the baseline's."""
    head = [
        "variant",
        "runs ok",
        "rollouts gen",
        "fresh+replay",
        "filtered",
        "expired",
        "skipped",
        "reward start",
        "reward end",
        "mixed end",
        "step@target (reached)",
        "rollouts@target",
        "wall s",
    ]
    table = [head]
    for v in summary["variants"]:
        ra = v["ratios"]

        def with_ratio(key: str, fmt: str, ra: dict[str, Any] = ra, v: dict[str, Any] = v) -> str:
            text = _stat(v[key], fmt)
            return text + ("" if ra[key] is None else f" (x{ra[key]:.2f})")

        fresh, replay = v["trained_fresh"]["mean"], v["replayed"]["mean"]
        reached = f" ({v['step_to_target']['n']}/{v['n']})"
        table.append(
            [
                v["name"],
                f"{v['ok']}/{v['n']}",
                with_ratio("generated", ".0f"),
                "-" if fresh is None else f"{fresh:.0f}+{replay:.0f}",
                _stat(v["filtered"], ".0f"),
                _stat(v["expired"], ".0f"),
                _stat(v["skipped_prompts"], ".0f"),
                _stat(v["reward_start"], ".3f"),
                _stat(v["reward_final"], ".3f"),
                _stat(v["mixed_end"], ".2f"),
                with_ratio("step_to_target", ".0f") + reached,
                with_ratio("rollouts_to_target", ".0f"),
                with_ratio("wall_s", ".0f"),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        f"seeds {', '.join(map(str, summary['seeds']))}; mean [min-max] over a variant's finished runs; "
        f"step@target and rollouts@target over the runs that reached it; ratios are of the means"
    )
    lines.append(
        f"baseline: {summary['baseline']}; target reward {_num(summary['target'], '.3f')} "
        f"({summary['target_rule']}, means over seeds), reached when a rolling mean over "
        f"{summary['window']} versions of the rollout reward gets there"
    )
    failures = [f"  {r['name']} seed {r['seed']}: {r['error']}" for r in summary["runs"] if not r["ok"]]
    if failures:
        lines.append("failed runs:")
        lines.extend(failures)
    return "\n".join(lines)

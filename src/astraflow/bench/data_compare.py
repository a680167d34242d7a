"""The data-efficiency benchmark's comparison (bench/data.py runs the recipes and reads each run back):
the reward target, the point where each run's rollout reward curve reaches it, per-variant aggregates
over seeds, ratios to the baseline, and the tables `astraflow bench data` prints.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from astraflow.bench.data import RunResult


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

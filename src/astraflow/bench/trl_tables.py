"""`astraflow bench trl`'s tables and its statistics over seeds (bench/trl.py runs the two sides): one
seed's comparison, several seeds' spread of steps to the reward target, and the held-out accuracy
against wall-clock seconds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.bench.trl import Side

WINDOW = 5
"""Steps in the rolling reward means the summary reports."""
TARGET = 0.8
"""Default reward target: the bench reports the first step whose WINDOW-step mean reaches it."""


def format_table(sides: list[Side], load: tuple[str, str], target: float = TARGET) -> str:
    """The comparison of one seed as text, with astraflow/TRL ratios of wall and step times."""
    s = {x.name: x.summary(target) for x in sides}
    lines = [f"{'':26}{'astraflow':>12}{'trl':>12}{'astraflow/trl':>16}"]

    def row(label: str, key: str, fmt: str, ratio: bool) -> None:
        a, t = s["astraflow"][key], s["trl"][key]
        cell = lambda v: "-" if v is None else format(v, fmt)  # noqa: E731
        r = f"{a / t:.2f}x" if ratio and a is not None and t else ""
        lines.append(f"{label:26}{cell(a):>12}{cell(t):>12}{r:>16}")

    row("wall s", "wall_s", ".1f", True)
    row("start->first step s", "startup_s", ".1f", True)
    row("first->last step s", "train_s", ".1f", True)
    row("last step->exit s", "shutdown_s", ".1f", True)
    row("cpu s (process tree)", "cpu_s", ".1f", True)
    row("steps", "steps", "d", False)
    row(f"reward first {WINDOW}", "reward_first", ".3f", False)
    row(f"reward last {WINDOW}", "reward_last", ".3f", False)
    row("reward last tenth", "reward_last_tenth", ".3f", False)
    row(f"step {WINDOW}-step mean >= {target:g}", "step_reaching", "d", True)
    lines.append("")
    for x in sides:
        lines.append(f"{x.name}: {x.note}")
    lines.append(f"load average before: {load[0]}; after: {load[1]}")
    return "\n".join(lines)


def spread(values: list[float]) -> dict[str, float] | None:
    """Mean, smallest, largest and sample standard deviation (0 for one value) of `values`."""
    if not values:
        return None
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return {"mean": mean, "min": min(values), "max": max(values), "std": var**0.5}


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One side over several seeds (Side.summary dicts): steps to the target (spread over the seeds
    that reached it, and how many did), reward over the last tenth, wall and CPU seconds."""
    reached = [float(x["step_reaching"]) for x in summaries if x["step_reaching"] is not None]
    return {
        "seeds": len(summaries),
        "reached": len(reached),
        "steps_to_target": [x["step_reaching"] for x in summaries],
        "step_reaching": spread(reached),
        "reward_last_tenth": spread(
            [float(x["reward_last_tenth"]) for x in summaries if x["reward_last_tenth"] is not None]
        ),
        "wall_s": spread([float(x["wall_s"]) for x in summaries]),
        "train_s": spread([float(x["train_s"]) for x in summaries]),
        "cpu_s": spread([float(x["cpu_s"]) for x in summaries if x.get("cpu_s") is not None]),
    }


def steps_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    """astraflow's mean steps to the target over TRL's; None unless every seed of both sides reached it."""
    if ours["reached"] < ours["seeds"] or theirs["reached"] < theirs["seeds"] or not ours["seeds"]:
        return None
    return float(ours["step_reaching"]["mean"] / theirs["step_reaching"]["mean"])


def format_seeds_table(
    seeds: list[int], agg: dict[str, dict[str, Any]], loads: list[tuple[str, str]], target: float
) -> str:
    """Several seeds as text: steps to the target per seed, their mean and spread per side, the
    reward over the last tenth, mean times, and the astraflow/TRL ratio of the mean steps."""
    ours, theirs = agg["astraflow"], agg["trl"]
    lines = [
        f"first step whose {WINDOW}-step mean reward >= {target:g}, seeds {', '.join(map(str, seeds))}",
        f"{'':30}{'astraflow':>14}{'trl':>14}{'astraflow/trl':>16}",
    ]

    def line(label: str, a: str, t: str, r: str = "") -> None:
        lines.append(f"{label:30}{a:>14}{t:>14}{r:>16}")

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for i, seed in enumerate(seeds):
        line(
            f"steps to {target:g}, seed {seed}",
            cell(ours["steps_to_target"][i], "d"),
            cell(theirs["steps_to_target"][i], "d"),
        )

    def stat(side: dict[str, Any], key: str, what: str, fmt: str) -> str:
        st = side[key]
        if st is None:
            return "-"
        if what == "range":
            return f"{st['min']:{fmt}}-{st['max']:{fmt}}"
        return format(st[what], fmt)

    ratio = steps_ratio(ours, theirs)
    line(
        f"steps to {target:g}, mean",
        stat(ours, "step_reaching", "mean", ".1f"),
        stat(theirs, "step_reaching", "mean", ".1f"),
        "-" if ratio is None else f"{ratio:.3f}x",
    )
    line(
        f"steps to {target:g}, min-max",
        stat(ours, "step_reaching", "range", ".0f"),
        stat(theirs, "step_reaching", "range", ".0f"),
    )
    line(
        f"steps to {target:g}, std",
        stat(ours, "step_reaching", "std", ".1f"),
        stat(theirs, "step_reaching", "std", ".1f"),
    )
    line("seeds reaching it", f"{ours['reached']}/{ours['seeds']}", f"{theirs['reached']}/{theirs['seeds']}")
    line(
        "reward last tenth, mean",
        stat(ours, "reward_last_tenth", "mean", ".3f"),
        stat(theirs, "reward_last_tenth", "mean", ".3f"),
    )
    line(
        "reward last tenth, min-max",
        stat(ours, "reward_last_tenth", "range", ".3f"),
        stat(theirs, "reward_last_tenth", "range", ".3f"),
    )
    for key, label in (
        ("wall_s", "wall s, mean"),
        ("train_s", "first->last step s, mean"),
        ("cpu_s", "cpu s, mean"),
    ):
        a, t = ours[key], theirs[key]
        r = f"{a['mean'] / t['mean']:.2f}x" if a and t and t["mean"] else ""
        line(label, stat(ours, key, "mean", ".1f"), stat(theirs, key, "mean", ".1f"), r)
    lines.append("")
    for seed, (before, after) in zip(seeds, loads, strict=True):
        lines.append(f"seed {seed}: load average before {before}; after {after}")
    return "\n".join(lines)


def format_heldout(res: dict[str, Any], label: str) -> str:
    """Held-out accuracy against wall-clock seconds of both sides as text."""
    curves = res["curves"]
    lines = [
        f"held-out accuracy ({label}, {res['prompts']} prompts, greedy, exact answer); seconds from the "
        f"side's process start to the end of the step",
        f"{'step':>6}{'astraflow s':>14}{'acc':>8}{'trl s':>12}{'acc':>8}",
    ]
    by_step: dict[int, dict[str, dict[str, float]]] = {}
    for name, points in curves.items():
        for p in points:
            by_step.setdefault(int(p["step"]), {})[name] = p
    for step in sorted(by_step):
        row = by_step[step]
        cells = []
        for name in ("astraflow", "trl"):
            p = row.get(name)
            cells += [f"{p['seconds']:.1f}", f"{p['accuracy']:.3f}"] if p else ["-", "-"]
        lines.append(f"{step:>6}{cells[0]:>14}{cells[1]:>8}{cells[2]:>12}{cells[3]:>8}")
    final = res["trl_final_accuracy"]
    reach = res["seconds_to_trl_final"]

    def cell(v: float | None) -> str:
        return "not reached" if v is None else f"{v:.1f}s"

    ratio = res["ratio"]
    lines.append(
        f"time to TRL's final held-out accuracy ({'-' if final is None else f'{final:.3f}'}): "
        f"astraflow {cell(reach['astraflow'])}, trl {cell(reach['trl'])}"
        + ("" if ratio is None else f", astraflow/trl {ratio:.2f}x")
    )
    return "\n".join(lines)

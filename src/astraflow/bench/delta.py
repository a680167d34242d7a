"""How big a version's delta is on a real training run: `astraflow bench delta RECIPE`.

Runs the recipe through `astraflow up` with `weights.mode = "delta"` and reads back, per version, the
share of elements whose bits changed and the delta's size as a share of the full version (the trainer's
metrics `weights_delta_changed` / `weights_delta_bytes` in metrics.jsonl), the encode time, and how the
workers pulled (their counters in logs/raas-<i>.stats.jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DELTA_SETS = ['weights.mode="delta"']
"""Overrides that turn deltas on (added after the user's own)."""


def delta_report(run_dir: Path) -> dict[str, Any]:
    """Per-version delta sizes of a finished run, their median, and the workers' pulls by way."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "weights_delta_bytes" in r]
    if not steps:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no delta metrics: was weights.mode delta?")
    resolved = json.loads((run_dir / "recipe.resolved.json").read_text())
    dtypes = {p["name"]: (p.get("trainer_options") or {}).get("dtype", "float32") for p in resolved["policy"]}
    pulls: dict[str, int] = {}
    for path in sorted((run_dir / "logs").glob("raas-*.stats.jsonl")):
        lines = path.read_text().splitlines()
        if lines:
            for k, v in json.loads(lines[-1]).get("weight_pulls", {}).items():
                pulls[k] = pulls.get(k, 0) + int(v)

    def median(key: str) -> float:
        xs = sorted(float(r[key]) for r in steps)
        return xs[len(xs) // 2]

    return {
        "run_dir": str(run_dir),
        "trainer_dtype": dtypes,
        "versions": [
            {
                "policy": r.get("policy", ""),
                "version": r.get("version", r.get("step")),
                "changed": r["weights_delta_changed"],
                "bytes": r["weights_delta_bytes"],
                "encode_s": r["weights_delta_encode_s"],
            }
            for r in steps
        ],
        "median_changed": median("weights_delta_changed"),
        "median_bytes": median("weights_delta_bytes"),
        "median_encode_s": median("weights_delta_encode_s"),
        "pulls": pulls,
    }


def format_delta_report(rep: dict[str, Any]) -> str:
    """The report as a few plain lines."""
    lines = [f"trainer dtype: {rep['trainer_dtype']}"]
    lines += [
        f"  {v['policy']}@{v['version']}: changed {v['changed']:.2%} of elements, delta {v['bytes']:.2%}"
        f" of the full version, encoded in {v['encode_s'] * 1000:.1f} ms"
        for v in rep["versions"]
    ]
    lines.append(
        f"median over {len(rep['versions'])} versions: changed {rep['median_changed']:.2%}, "
        f"delta {rep['median_bytes']:.2%} of the full version, encode {rep['median_encode_s'] * 1000:.1f} ms"
    )
    lines.append(f"worker pulls by way: {rep['pulls']}")
    return "\n".join(lines)

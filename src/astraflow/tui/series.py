"""Per-policy metric history kept by the dashboard, and the numbers derived from it (ETA, rates)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PLOT_POINTS = 400
"""Most points drawn per curve; longer histories are thinned evenly (the last point always kept)."""

KL_KEYS = ("kl", "approx_kl")
"""Metric names that carry a KL estimate, in order of preference."""


@dataclass
class Series:
    """Every metrics row of one policy, in step order."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    steps: set[Any] = field(default_factory=set)
    points: dict[str, tuple[int, list[tuple[float, float]]]] = field(default_factory=dict)
    """Per metric: (rows already scanned, their points), so a poll only scans the rows it added."""

    def add(self, rows: list[dict[str, Any]], prepend: bool = False) -> None:
        """Add rows (new ones at the end, older history at the front), skipping steps already held."""
        fresh = [r for r in rows if r.get("step") not in self.steps]
        self.steps.update(r.get("step") for r in fresh)
        if prepend and fresh:
            self.points.clear()
        self.rows = fresh + self.rows if prepend else self.rows + fresh

    def curve(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of one metric, thinned to at most PLOT_POINTS points."""
        done, pts = self.points.get(key, (0, []))
        pts = pts + [
            (float(r["step"]), float(r[key]))
            for r in self.rows[done:]
            if isinstance(r.get(key), int | float) and isinstance(r.get("step"), int)
        ]
        self.points[key] = (len(self.rows), pts)
        if len(pts) > PLOT_POINTS:
            stride = len(pts) / PLOT_POINTS
            pts = [pts[int(i * stride)] for i in range(PLOT_POINTS - 1)] + [pts[-1]]
        return [p[0] for p in pts], [p[1] for p in pts]

    def kl_key(self) -> str | None:
        """The KL metric this policy's objective reports, if any."""
        last = self.rows[-1] if self.rows else {}
        return next((k for k in KL_KEYS if k in last), None)

    def last(self) -> dict[str, Any]:
        """The newest row ({} before the first step)."""
        return self.rows[-1] if self.rows else {}

    def eta_s(self, budget: int, window: int = 20) -> float | None:
        """Seconds to the step budget at the pace of the last `window` steps (None without a pace)."""
        timed = [r for r in self.rows[-window:] if isinstance(r.get("time"), int | float)]
        if len(timed) < 2:
            return None
        a, b = timed[0], timed[-1]
        dt, ds = float(b["time"]) - float(a["time"]), int(b["step"]) - int(a["step"])
        if dt <= 0 or ds <= 0:
            return None
        return max(0, budget - int(b["step"])) * dt / ds

    def data_counters(self) -> dict[str, float]:
        """The newest `data/...` counters (pipeline totals and each stage's counters)."""
        return {k: float(v) for k, v in self.last().items() if k.startswith("data/")}


def fmt_duration(s: float | None) -> str:
    """12s, 3m05s, 2h01m; '-' when unknown."""
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def progress_bar(done: int, total: int, width: int = 30) -> str:
    """A text bar like [######------]."""
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    n = int(round(frac * width))
    return "[" + "#" * n + "-" * (width - n) + "]"


MISMATCH = "trainer/mismatch/"
"""Prefix of the trainer's engine-vs-trainer mismatch metrics (trainers/mismatch.py)."""


def mismatch_text(last: dict[str, Any]) -> str:
    """The newest step's importance ratio over fresh and over stale tokens, for the progress line
    ("" when the trainer reports none)."""
    fresh, stale = last.get(MISMATCH + "ratio_fresh"), last.get(MISMATCH + "ratio_stale")
    if fresh is None:
        return ""
    parts = [f"ratio fresh {float(fresh):.4f}"]
    if float(last.get(MISMATCH + "tokens_stale", 0.0)) > 0 and stale is not None:
        parts.append(f"stale {float(stale):.4f}")
    return " ".join(parts) + "  "

"""The console of `astraflow up` without a dashboard: a line per trainer step and per kind of failure."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class MetricsTail:
    """Follows metrics.jsonl and yields new records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        """New complete records since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        out = []
        for line in complete:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out


def progress_line(rec: dict[str, Any], steps: int | dict[str, int]) -> str:
    """One human-readable progress line per trainer step."""

    def f(key: str, fmt: str = ".3f") -> str:
        v = rec.get(key)
        return "-" if v is None else format(v, fmt)

    if rec.get("kind") == "eval":
        scores = "  ".join(f"{k[5:]} {v:.3f}" for k, v in sorted(rec.items()) if k.startswith("eval/"))
        return f"[{rec.get('policy', '?')}] eval of version {rec.get('version', '?')}  {scores}"
    if isinstance(steps, dict):
        steps = steps.get(str(rec.get("policy")), 0)
    return (
        f"[{rec.get('policy', '?')}] step {rec.get('step', '?')}/{steps}  version {rec.get('version', '?')}  "
        f"reward {f('reward_mean')}  samples/s {f('samples_per_s', '.1f')}  "
        f"staleness {f('staleness_mean', '.2f')}/{f('staleness_max', '.0f')}"
        + ("  SKIPPED: non-finite loss or gradient norm" if rec.get("trainer_skipped_step") else "")
    )


class Progress:
    """The console of a run without a dashboard: a line per trainer step (from metrics.jsonl) and, at
    most once a second, a line per kind of task failure (from state.db); it also tracks each policy's
    step reached. With `show` off (a dashboard owns the terminal) it reads and prints nothing."""

    def __init__(self, run_dir: Path, budgets: dict[str, int], show: bool) -> None:
        from astraflow.state.failure_tail import FailureTail

        self.metrics = MetricsTail(run_dir / "metrics.jsonl")
        self.fails = FailureTail(run_dir / "state.db")
        self.budgets = budgets
        self.show = show
        self.reached: dict[str, int] = {}
        self._next_fail_read = 0.0

    def poll(self) -> None:
        """Print the new step lines, and the new failures when a second has passed since the last read."""
        self.steps()
        if time.monotonic() >= self._next_fail_read:
            # one line per kind and second (the full traceback is in the controller log)
            self._next_fail_read = time.monotonic() + 1.0
            self.failures()

    def steps(self) -> None:
        """Print a line per new step row (consumed either way) and record the step each policy reached."""
        for rec in self.metrics.read():
            if "step" in rec and "policy" in rec and rec.get("kind") != "late":
                self.reached[rec["policy"]] = max(self.reached.get(rec["policy"], 0), int(rec["step"]))
                if self.show:
                    sys.stdout.write(progress_line(rec, self.budgets) + "\n")
                    sys.stdout.flush()

    def failures(self) -> None:
        """Print the task failures recorded since the last read."""
        for line in self.fails.read():
            if self.show:
                sys.stdout.write(line + "\n")
        sys.stdout.flush()

    @property
    def all_reached(self) -> bool:
        """Every trainable policy has reached its step budget."""
        return all(self.reached.get(p, 0) >= b for p, b in self.budgets.items())

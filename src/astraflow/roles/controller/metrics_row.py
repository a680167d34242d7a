"""The metrics row of a finished step (batch reward and staleness, pipeline counters, the trainer's
metrics), given to the metric sinks once committed; rows a kill kept from metrics.jsonl are written
again at start-up (metrics/recovery.py)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from astraflow import log
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.pipeline import Pipeline
from astraflow.metrics.sinks import SinkFailed, Sinks
from astraflow.protocol import messages as m
from astraflow.roles.controller.run_end import RunEnd
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store

_log = log.get("controller")


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What a step's metrics row reads: the buffer, the ledger, the pipelines and the sample rate."""

    store: Store
    buffer: Buffer
    ledger: Ledger
    pipeline: Pipeline
    rate_hist: dict[str, deque[tuple[float, int]]]
    """Policy -> the last (time, samples generated) pairs the sample rate is measured over."""
    archived: bool
    """A retention pass may have moved trajectories to the archive (their counts are added back)."""

    def row(self, msg: m.VersionPublished, now: float) -> dict[str, Any]:
        """The metrics row of a finished step: batch reward and staleness, pipeline counters, trainer metrics."""
        rec = self.buffer.recorded_ids(msg.policy, msg.step)
        ref = rec[2] if rec else msg.version - 1
        fresh_ids = [i for i, replay in zip(rec[0], rec[1], strict=True) if not replay] if rec else []
        rewards, oldest, task_ids = self.buffer.taken(msg.policy, msg.step, fresh_ids)
        counts = self._counts(msg.policy)
        generated = self.buffer.generated(msg.policy)
        row: dict[str, Any] = dict(self.pipeline.metrics(msg.policy))
        row.update(self.pipeline.take_info(msg.policy, task_ids.tolist()))
        row.update(self.buffer.role_metrics(fresh_ids))
        row.update(
            {
                "policy": msg.policy,
                "step": msg.step,
                "version": msg.version,
                "time": now,
                **batch_figures(ref, rewards, oldest),
                "samples_per_s": self._rate(msg.policy, now, generated),
                "samples_generated": generated,
                "expired": counts["expired"],
                "dropped": counts["dropped"],
                "buffered": counts["buffered"],
                **{f"tasks_{k}": v for k, v in self.ledger.counts().items()},
            }
        )
        # a peer's NaN would be stored as NULL or as text no JSON reader takes
        return with_trainer_metrics(row, {k: float(v) for k, v in msg.metrics.items() if math.isfinite(v)})

    def _counts(self, policy: str) -> dict[str, int]:
        """The policy's trajectories by status, with those a retention pass archived added back."""
        counts = self.buffer.open_counts(policy)
        if self.archived:
            from astraflow.state.archive import archived_counts

            for k, v in archived_counts(self.store, policy).items():
                if k in counts:
                    counts[k] += v
        return counts

    def _rate(self, policy: str, now: float, generated: int) -> float:
        """Samples generated per second over the policy's last few steps."""
        hist = self.rate_hist.setdefault(policy, deque(maxlen=6))
        hist.append((now, generated))
        t0, g0 = hist[0]
        return (generated - g0) / (now - t0) if now > t0 else 0.0


def batch_figures(ref: int, rewards: np.ndarray[Any, Any], oldest: np.ndarray[Any, Any]) -> dict[str, float]:
    """A batch's mean reward and its staleness (mean and max of `ref` - each sequence's oldest version),
    from its fresh sequences' columns in id order, without a Python object a sequence."""
    n = len(rewards)
    if not n:
        return {"reward_mean": 0.0, "staleness_mean": 0.0, "staleness_max": 0.0}
    return {
        # Python's sum of the floats in id order: the value a sum over the rows one by one gives
        "reward_mean": sum(rewards.tolist()) / n,
        # integers, summed exactly
        "staleness_mean": (ref * n - int(oldest.sum())) / n,
        "staleness_max": float(ref - int(oldest.min())),
    }


def with_trainer_metrics(row: dict[str, Any], trainer: dict[str, float]) -> dict[str, Any]:
    """The controller's row plus the trainer's metrics; a trainer metric named like one of the
    controller's keeps its own value as `trainer/<name>`, so each name has one definition."""
    for k, v in trainer.items():
        name = f"trainer/{k}" if k in row and f"trainer/{k}" not in trainer else k
        row.setdefault(name, float(v))
    return row


def emit(sinks: Sinks, run: RunEnd, row: dict[str, Any]) -> None:
    """Give a committed metrics row to the sinks; metrics.jsonl failing to take it ends the run."""
    try:
        sinks.write(row)
    except SinkFailed as exc:
        run.fail(f"{exc}; {exc.hint}")


def rewrite_lost_rows(store: Store, metrics_path: Path, sinks: Sinks, run: RunEnd) -> None:
    """Give the sinks the step rows a kill between a step's commit and its sink writes kept from
    metrics.jsonl (metrics/recovery.py)."""
    from astraflow.metrics.recovery import lost_rows

    rows = lost_rows(store, metrics_path)
    if rows:
        _log.info("rewriting %d metrics rows missing from metrics.jsonl", len(rows))
        with store.write():
            store.add_event("metrics_rewritten", f"{len(rows)} step rows from state.db")
    for row in rows:
        emit(sinks, run, row)

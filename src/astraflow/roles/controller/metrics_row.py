"""The metrics row of a finished step (batch reward and staleness, pipeline counters, the trainer's
metrics), given to the metric sinks once committed; rows a kill kept from metrics.jsonl are written
again at start-up (metrics/recovery.py)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from astraflow import log
from astraflow.metrics.sinks import SinkFailed
from astraflow.protocol import messages as m
from astraflow.roles.controller.core import ControllerCore
from astraflow.state import trajectories

_log = log.get("controller")


def step_metrics(ctl: ControllerCore, msg: m.VersionPublished, now: float) -> dict[str, Any]:
    """The metrics row of a finished step: batch reward and staleness, pipeline counters, trainer metrics."""
    rec = ctl.buffer.recorded_ids(msg.policy, msg.step)
    ref = rec[2] if rec else msg.version - 1
    fresh_ids = [i for i, replay in zip(rec[0], rec[1], strict=True) if not replay] if rec else []
    rewards: list[float] = []
    stale: list[int] = []
    task_ids: list[int] = []
    for reward, min_version, task_id in trajectories.reward_rows(ctl.store, fresh_ids):
        rewards.append(reward)
        stale.append(ref - min_version)
        task_ids.append(task_id)
    counts = ctl.buffer.open_counts(msg.policy)
    if ctl.recipe.controller.retention.keep_steps is not None:
        from astraflow.state.archive import archived_counts

        for k, v in archived_counts(ctl.store, msg.policy).items():
            if k in counts:
                counts[k] += v
    tasks = ctl.ledger.counts()
    generated = ctl.buffer.generated(msg.policy)
    hist = ctl.rate_hist.setdefault(msg.policy, deque(maxlen=6))
    hist.append((now, generated))
    t0, g0 = hist[0]
    rate = (generated - g0) / (now - t0) if now > t0 else 0.0
    row: dict[str, Any] = dict(ctl.pipeline.metrics(msg.policy))
    row.update(ctl.pipeline.take_info(msg.policy, task_ids))
    row.update(ctl.buffer.role_metrics(fresh_ids))
    row.update(
        {
            "policy": msg.policy,
            "step": msg.step,
            "version": msg.version,
            "time": now,
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "samples_per_s": rate,
            "samples_generated": generated,
            "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "staleness_max": float(max(stale)) if stale else 0.0,
            "expired": counts["expired"],
            "dropped": counts["dropped"],
            "buffered": counts["buffered"],
            **{f"tasks_{k}": v for k, v in tasks.items()},
        }
    )
    # a peer's NaN would be stored as NULL or as text no JSON reader takes
    return with_trainer_metrics(row, {k: float(v) for k, v in msg.metrics.items() if math.isfinite(v)})


def with_trainer_metrics(row: dict[str, Any], trainer: dict[str, float]) -> dict[str, Any]:
    """The controller's row plus the trainer's metrics; a trainer metric named like one of the
    controller's keeps its own value as `trainer/<name>`, so each name has one definition."""
    for k, v in trainer.items():
        name = f"trainer/{k}" if k in row and f"trainer/{k}" not in trainer else k
        row.setdefault(name, float(v))
    return row


def emit(ctl: ControllerCore, row: dict[str, Any]) -> None:
    """Give a committed metrics row to the sinks; metrics.jsonl failing to take it ends the run."""
    try:
        ctl.sinks.write(row)
    except SinkFailed as exc:
        ctl.end_run_failed(f"{exc}; {exc.hint}")


def rewrite_lost_rows(ctl: ControllerCore) -> None:
    """Give the sinks the step rows a kill between a step's commit and its sink writes kept from
    metrics.jsonl (metrics/recovery.py)."""
    from astraflow.metrics.recovery import lost_rows

    rows = lost_rows(ctl.store, ctl.run_dir / "metrics.jsonl")
    if rows:
        _log.info("rewriting %d metrics rows missing from metrics.jsonl", len(rows))
        with ctl.store.write():
            ctl.store.add_event("metrics_rewritten", f"{len(rows)} step rows from state.db")
    for row in rows:
        emit(ctl, row)

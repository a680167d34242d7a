"""Versions: a trainer's VersionPublished records the policy's new version and step, writes the step's
metrics row, tells the curators and the eval rounds, and runs a retention pass when one is due. A known
version announced again adds the metrics its row lacks (a delta's, which follow the version)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.config.recipe import RetentionConfig
from astraflow.dataflow.evaluation import Evaluator
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.stall import Progress
from astraflow.metrics.sinks import Sinks
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.roles.controller.metrics_row import StepMetrics, emit
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.progress import made_progress
from astraflow.roles.controller.run_end import RunEnd
from astraflow.state.archiver import Archiver
from astraflow.state.store import Store

_log = log.get("controller")


@dataclass(frozen=True, slots=True)
class Publishing:
    """What recording a version reads and changes: the version stream, the step's metrics row and its
    sinks, the curators and the eval rounds, the stall clock, the retention pass."""

    store: Store
    versions: PolicyVersions
    pipeline: Pipeline
    metrics: StepMetrics
    sinks: Sinks
    evals: Evaluator | None
    progress: Progress
    run: RunEnd
    retention: RetentionConfig
    """controller.retention: when and how trajectories trained on long ago leave state.db."""
    run_dir: Path
    """Where the retention pass's archive is written."""
    archiver: Archiver | None = None
    """Runs the reading half of `archive` passes in a process of its own (controller.retention.archiver)."""


def on_version(ctx: Publishing, member: dict[str, Any], msg: m.VersionPublished) -> Outcome:
    """Record the version and step, write the step's metrics, tell the curators; then ack (a new
    version is an event: the held task requests are answered with it)."""
    if msg.policy not in ctx.pipeline.policies:
        error = m.Error(rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run")
        return Outcome(error)
    refused = authz.version_refusal(ctx.store, msg)
    if refused is not None:
        _log.warning(
            "refused version %d of %s from %s: %s", msg.version, msg.policy, member["id"], refused[1]
        )
        return Outcome(m.Error(rid=msg.rid, code=refused[0], message=refused[1]))
    now = time.time()
    ctx.versions.offer(msg)
    with ctx.store.write():
        new = ctx.store.record_version(
            msg.policy, msg.version, msg.step, msg.weights_addr, msg.sha256, msg.nbytes
        )
        ctx.versions.changed()
        row: dict[str, Any] | None = None
        if new:
            row = ctx.metrics.row(msg, now)
            ctx.store.add_metrics(
                msg.policy, msg.step, {k: v for k, v in row.items() if isinstance(v, int | float)}, now
            )
            ctx.pipeline.on_version(msg.policy, msg.version)
            _note_skipped(ctx.store, msg)
            if ctx.evals is not None:
                ctx.evals.on_version(msg.policy, msg.version, msg.step)
            made_progress(ctx.store, ctx.progress, now)
        late = None if new or not msg.metrics else late_row(ctx.store, msg, now)
    if row is not None:
        emit(ctx.sinks, ctx.run, row)
        take_archived(ctx.store, ctx.archiver)  # a finished pass first: one in flight skips the next
        retire(ctx.store, ctx.run_dir, ctx.retention, msg.policy, msg.step, ctx.archiver)
    if late is not None:
        emit(ctx.sinks, ctx.run, late)
    ack = m.Ack(rid=msg.rid, detail="recorded" if new else "known")
    return Outcome(ack, (Event.VERSION_RECORDED,) if new else ())


def late_row(store: Store, msg: m.VersionPublished, now: float) -> dict[str, Any] | None:
    """Merge the metrics of a known version's later announcement into its step's row (names the row
    lacks only: what the row holds, the version's identity among it, never changes); the sinks' row
    of what was added (`"kind": "late"`, docs/metrics.md), or None when nothing was."""
    trainer = {k: float(v) for k, v in msg.metrics.items() if math.isfinite(v)}
    added = store.merge_metrics(msg.policy, msg.step, trainer)
    if not added:
        return None
    return {
        "kind": "late",
        "policy": msg.policy,
        "step": msg.step,
        "version": msg.version,
        "time": now,
        **added,
    }


def retire(
    store: Store,
    run_dir: Path,
    keep: RetentionConfig,
    policy: str,
    step: int,
    archiver: Archiver | None = None,
) -> None:
    """A retention pass (controller.retention) every `every_steps` steps of a policy: trajectories
    trained on long ago leave state.db for the archive (state/archive.py), or are dropped; then the
    done tasks older than every trajectory left leave too (state/tasks.py, counted per owner). With
    an archiver (state/archiver.py) an `archive` pass is handed to it and finished by `take_archived`."""
    if keep.keep_steps is None or step % keep.every_steps:
        return
    from astraflow.state import archive

    if archiver is not None and keep.action == "archive" and archiver.submit(policy, step, keep.keep_steps):
        return
    _passed(
        store, policy, archive.retire(store, run_dir, policy, step, keep.keep_steps, keep.action), keep.action
    )


def take_archived(store: Store, archiver: Archiver | None, wait_s: float = 0.0) -> None:
    """Finish the pass the archiver found, if one is done (within `wait_s`): its rows leave state.db
    in one transaction."""
    if archiver is None or not archiver.busy:
        return
    found = archiver.collect(store, wait_s)
    if found is not None:
        _passed(store, found.policy, found.rows, "archive")


def archiver_of(keep: RetentionConfig, run_dir: Path) -> Archiver | None:
    """The archiver of `archive` passes when controller.retention.archiver is "process" (not started yet)."""
    wanted = keep.keep_steps is not None and keep.action == "archive" and keep.archiver == "process"
    return Archiver(run_dir) if wanted else None


def close_archiver(store: Store, archiver: Archiver | None, wait_s: float = 30.0) -> None:
    """Finish the pass in flight (waiting up to `wait_s`) and end the archiver process."""
    if archiver is not None:
        take_archived(store, archiver, wait_s)
        archiver.close()


def _passed(store: Store, policy: str, n: int, action: str) -> None:
    """After a pass moved `n` rows: log it, and the done tasks older than every trajectory left leave."""
    if not n:
        return
    from astraflow.state import tasks

    _log.info("retention: %d trajectories of %s left state.db (%s)", n, policy, action)
    done = tasks.retire_done(store)
    if done:
        _log.info("retention: %d done tasks left state.db", done)


def _note_skipped(store: Store, msg: m.VersionPublished) -> None:
    """A step the trainer skipped (non-finite loss or gradient norm) becomes a `step_skipped` event."""
    if not msg.metrics.get("trainer_skipped_step"):
        return
    in_a_row = int(msg.metrics.get("trainer_skipped_in_a_row", 1))
    detail = {"policy": msg.policy, "step": msg.step, "in_a_row": in_a_row}
    store.add_event("step_skipped", json.dumps(detail, sort_keys=True))
    _log.warning(
        "policy %s step %d was skipped by its trainer: non-finite loss or gradient norm (%d in a row)",
        msg.policy,
        msg.step,
        in_a_row,
    )

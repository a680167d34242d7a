"""Versions: a trainer's VersionPublished records the policy's new version and step, writes the step's
metrics row, tells the curators and the eval rounds, and runs a retention pass when one is due."""

from __future__ import annotations

import json
import time
from typing import Any

from astraflow import log
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.roles.controller.core import ControllerCore
from astraflow.roles.controller.metrics_row import emit, step_metrics
from astraflow.roles.controller.outcome import Event, Outcome

_log = log.get("controller")


def on_version(ctl: ControllerCore, member: dict[str, Any], msg: m.VersionPublished) -> Outcome:
    """Record the version and step, write the step's metrics, tell the curators; then ack (a new
    version is an event: the held task requests are answered with it)."""
    if msg.policy not in ctl.pipeline.policies:
        error = m.Error(rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run")
        return Outcome(error)
    refused = authz.version_refusal(ctl.store, msg)
    if refused is not None:
        _log.warning(
            "refused version %d of %s from %s: %s", msg.version, msg.policy, member["id"], refused[1]
        )
        return Outcome(m.Error(rid=msg.rid, code=refused[0], message=refused[1]))
    now = time.time()
    if msg.offers and msg.version >= ctl.offers.get(msg.policy, (-1, []))[0]:
        ctl.offers[msg.policy] = (msg.version, list(msg.offers))
    with ctl.store.write():
        new = ctl.store.record_version(
            msg.policy, msg.version, msg.step, msg.weights_addr, msg.sha256, msg.nbytes
        )
        ctl.versions_changed()
        row: dict[str, Any] | None = None
        if new:
            row = step_metrics(ctl, msg, now)
            ctl.store.add_metrics(
                msg.policy, msg.step, {k: v for k, v in row.items() if isinstance(v, int | float)}, now
            )
            ctl.pipeline.on_version(msg.policy, msg.version)
            _note_skipped(ctl, msg)
            if ctl.evals is not None:
                ctl.evals.on_version(msg.policy, msg.version, msg.step)
            ctl.made_progress(now)
    if row is not None:
        emit(ctl, row)
        retire(ctl, msg.policy, msg.step)
    ack = m.Ack(rid=msg.rid, detail="recorded" if new else "known")
    return Outcome(ack, (Event.VERSION_RECORDED,) if new else ())


def retire(ctl: ControllerCore, policy: str, step: int) -> None:
    """A retention pass (controller.retention) every `every_steps` steps of a policy: trajectories
    trained on long ago leave state.db for the archive (state/archive.py), or are dropped; then the
    done tasks older than every trajectory left leave too (state/tasks.py, counted per owner)."""
    keep = ctl.recipe.controller.retention
    if keep.keep_steps is None or step % keep.every_steps:
        return
    from astraflow.state import archive, tasks

    n = archive.retire(ctl.store, ctl.run_dir, policy, step, keep.keep_steps, keep.action)
    if n:
        _log.info("retention: %d trajectories of %s left state.db (%s)", n, policy, keep.action)
        done = tasks.retire_done(ctl.store)
        if done:
            _log.info("retention: %d done tasks left state.db", done)


def _note_skipped(ctl: ControllerCore, msg: m.VersionPublished) -> None:
    """A step the trainer skipped (non-finite loss or gradient norm) becomes a `step_skipped` event."""
    if not msg.metrics.get("trainer_skipped_step"):
        return
    in_a_row = int(msg.metrics.get("trainer_skipped_in_a_row", 1))
    detail = {"policy": msg.policy, "step": msg.step, "in_a_row": in_a_row}
    ctl.store.add_event("step_skipped", json.dumps(detail, sort_keys=True))
    _log.warning(
        "policy %s step %d was skipped by its trainer: non-finite loss or gradient norm (%d in a row)",
        msg.policy,
        msg.step,
        in_a_row,
    )

"""Batches: a trainer's BatchRequest for step k is answered with the step's recorded batch (in parts of
at most `controller.batch_part_bytes`), a new one, "not ready yet", or "done"."""

from __future__ import annotations

from typing import Any

from astraflow.dataflow.batch_parts import part_bounds
from astraflow.dataflow.limits import seq_bytes
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.roles.controller.core import RETRY_S, ControllerCore, summary
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.parked import Parked
from astraflow.state import trajectories


def on_batch_request(ctl: ControllerCore, member: dict[str, Any], msg: m.BatchRequest) -> Outcome:
    """The recorded batch of the step, a new one, not ready yet, or done (a batch or part served is
    an event: admission may have room for more tasks)."""
    reply = _batch_reply(ctl, msg)
    served = isinstance(reply, m.BatchReply) and reply.ready
    return Outcome(reply, (Event.BATCH_SERVED,) if served else ())


def _batch_reply(ctl: ControllerCore, msg: m.BatchRequest) -> m.Msg:
    """The reply to one BatchRequest."""
    try:
        pol = ctl.recipe.get_policy(msg.policy)
    except KeyError:
        return m.Error(rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run")
    if msg.step < 1:
        return m.Error(rid=msg.rid, code="bad_request", message="steps are numbered from 1")
    if ctl.failed is not None:
        return m.Error(rid=msg.rid, code="run_failed", message=f"the run failed: {summary(ctl.failed)}")
    if msg.step > ctl.recipe.budget(msg.policy) or ctl.control.stopped:
        # an operator's stop ends the trainer after the step it holds (it checkpoints, exits 0)
        if not ctl.control.stopped and ctl.evals_pending():
            # the trainer's weight server must outlive the last eval round, which may still pull it
            return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
        return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, done=True)
    refused = authz.batch_refusal(ctl.store, msg.policy, msg.step)
    if refused is not None:
        return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
    if msg.part > 0:
        return _batch_part(ctl, msg)
    # a trainer one step ahead holds version step-1 (still being announced): staleness counts from it
    version = max(int(ctl.store.policy(msg.policy)["version"]), msg.step - 1)
    with ctl.store.write():
        # the batch, its trajectories' status and the composers' counters commit together
        batch = ctl.buffer.next_batch(
            msg.policy, msg.step, pol.batch_prompts * pol.group_size, pol.max_staleness, version
        )
        if batch is not None and batch.new:
            ctl.pipeline.on_batch(msg.policy, sum(1 for s in batch.samples if s.replay))
            ctl.pipeline.save(msg.policy)
    if batch is None:
        ctl.refill()
        return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
    if batch.new:
        ctl.made_progress()
    bounds = _part_bounds(ctl, [s.traj_id for s in batch.samples], [s.length for s in batch.samples])
    served = ctl.pipeline.batch_samples(msg.policy, batch.samples)  # the estimator's batch stage
    return m.BatchReply(
        rid=msg.rid,
        policy=msg.policy,
        step=msg.step,
        samples=served[: bounds[0][1]],
        ready=True,
        parts=len(bounds),
    )


def _part_bounds(
    ctl: ControllerCore, ids: list[int], lengths: list[int] | None = None
) -> list[tuple[int, int]]:
    """Where a recorded batch of these trajectories splits into parts (dataflow/batch_parts.py);
    `lengths` (tokens per sample, when at hand) skip the size query for a batch that surely fits."""
    budget = ctl.recipe.controller.batch_part_bytes
    if lengths is not None and sum(seq_bytes(n) for n in lengths) <= budget:
        return [(0, len(ids))]  # the exact sizes are smaller still: the same answer
    return part_bounds(ctl.buffer.sample_bytes(ids), budget)


def _batch_part(ctl: ControllerCore, msg: m.BatchRequest) -> m.Msg:
    """Part `msg.part` (> 0) of a recorded batch."""
    rec = ctl.buffer.recorded_ids(msg.policy, msg.step)
    bounds = _part_bounds(ctl, rec[0]) if rec is not None else []
    if rec is None or msg.part >= len(bounds):
        return m.Error(
            rid=msg.rid,
            code="bad_request",
            message=f"step {msg.step} of {msg.policy!r} has no recorded part {msg.part} ({len(bounds)} parts)",
        )
    a, b = bounds[msg.part]
    samples = ctl.buffer.samples(rec[0][a:b], rec[1][a:b])
    if ctl.pipeline.batch_level(msg.policy):  # normalised over the whole batch, not this part
        samples = ctl.pipeline.batch_samples(msg.policy, samples, ctl.buffer.advantages(rec[0]), a)
    return m.BatchReply(
        rid=msg.rid,
        policy=msg.policy,
        step=msg.step,
        samples=samples,
        ready=True,
        part=msg.part,
        parts=len(bounds),
    )


def batch_may_be_ready(ctl: ControllerCore, parked: Parked) -> bool:
    """Whether the policy of a held BatchRequest has at least a batch's fresh sequences buffered."""
    policy = getattr(parked.msg, "policy", "")
    try:
        pol = ctl.recipe.get_policy(policy)
    except KeyError:
        return True  # answered with its error at once
    need = ctl.pipeline.fresh_per_batch(policy, pol.batch_prompts * pol.group_size)
    return trajectories.count(ctl.store, policy, "buffered") >= need

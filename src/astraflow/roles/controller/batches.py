"""Batches: a trainer's BatchRequest for step k is answered with the step's recorded batch (in parts of
at most `controller.batch_part_bytes`), a new one, "not ready yet", or "done"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astraflow.config.recipe import PolicyConfig
from astraflow.dataflow.batch_parts import part_bounds
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.limits import samples_bytes
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.stall import Progress
from astraflow.protocol import messages as m
from astraflow.protocol import sample_columns
from astraflow.roles import authz
from astraflow.roles.controller.core import RETRY_S
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.parked import Parked
from astraflow.roles.controller.progress import made_progress
from astraflow.roles.controller.run_end import RunEnd, summary
from astraflow.roles.controller.task_queue import TaskQueue
from astraflow.state.store import Store


@dataclass(frozen=True, slots=True)
class Batching:
    """What serving a batch reads and changes: the policies' sections and budgets, the buffer and the
    stage pipeline, the task queue (refilled while a batch is short), the stall clock, the run's end."""

    policies: dict[str, PolicyConfig]
    """Policy name -> its `[[policy]]` section."""
    budgets: dict[str, int]
    """Policy name -> its step budget (0 for a frozen policy)."""
    batch_part_bytes: int
    """controller.batch_part_bytes: the most a part of a batch carries."""
    store: Store
    buffer: Buffer
    pipeline: Pipeline
    queue: TaskQueue
    progress: Progress
    run: RunEnd


def on_batch_request(ctx: Batching, member: dict[str, Any], msg: m.BatchRequest) -> Outcome:
    """The recorded batch of the step, a new one, not ready yet, or done (a batch or part served is
    an event: admission may have room for more tasks)."""
    reply = _batch_reply(ctx, msg)
    served = isinstance(reply, m.BatchReply) and reply.ready
    return Outcome(reply, (Event.BATCH_SERVED,) if served else ())


def _batch_reply(ctx: Batching, msg: m.BatchRequest) -> m.Msg:
    """The reply to one BatchRequest."""
    pol = ctx.policies.get(msg.policy)
    if pol is None:
        return m.Error(rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run")
    early = _not_a_batch(ctx, msg)
    if early is not None:
        return early
    if msg.part > 0:
        return _batch_part(ctx, msg)
    return _first_part(ctx, msg, pol)


def _not_a_batch(ctx: Batching, msg: m.BatchRequest) -> m.Msg | None:
    """The reply when this step gets no batch (a bad step, the run failed or is over, a refusal), or None."""
    if msg.step < 1:
        return m.Error(rid=msg.rid, code="bad_request", message="steps are numbered from 1")
    if ctx.run.failed is not None:
        return m.Error(rid=msg.rid, code="run_failed", message=f"the run failed: {summary(ctx.run.failed)}")
    if msg.step > ctx.budgets[msg.policy] or ctx.run.control.stopped:
        # an operator's stop ends the trainer after the step it holds (it checkpoints, exits 0)
        if not ctx.run.control.stopped and ctx.run.evals_pending():
            # the trainer's weight server must outlive the last eval round, which may still pull it
            return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
        return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, done=True)
    refused = authz.batch_refusal(ctx.store, msg.policy, msg.step)
    if refused is not None:
        return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
    return None


def _first_part(ctx: Batching, msg: m.BatchRequest, pol: PolicyConfig) -> m.Msg:
    """The step's batch (recorded now, or as recorded before), its first part; or "not yet"."""
    # a trainer one step ahead holds version step-1 (still being announced): staleness counts from it
    version = max(int(ctx.store.policy(msg.policy)["version"]), msg.step - 1)
    with ctx.store.write():
        # the batch, its trajectories' status and the composers' counters commit together
        batch = ctx.buffer.next_batch(
            msg.policy, msg.step, pol.batch_prompts * pol.group_size, pol.max_staleness, version
        )
        if batch is not None and batch.new:
            ctx.pipeline.on_batch(msg.policy, sample_columns.replayed(batch.columns))
            ctx.pipeline.save(msg.policy)
    if batch is None:
        ctx.queue.refill()
        return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
    if batch.new:
        made_progress(ctx.store, ctx.progress)
    cols = batch.columns
    bounds = _part_bounds(ctx, sample_columns.id_list(cols), sample_columns.token_count(cols))
    served = ctx.pipeline.batch_columns(msg.policy, cols)  # the estimator's batch stage
    return m.BatchReply(
        rid=msg.rid,
        policy=msg.policy,
        step=msg.step,
        columns=sample_columns.part(served, 0, bounds[0][1]),
        ready=True,
        parts=len(bounds),
    )


def _part_bounds(ctx: Batching, ids: list[int], tokens: int | None = None) -> list[tuple[int, int]]:
    """Where a recorded batch of these trajectories splits into parts (dataflow/batch_parts.py);
    `tokens` (of all its samples, when at hand) skip the size query for a batch that surely fits."""
    budget = ctx.batch_part_bytes
    if tokens is not None and samples_bytes(tokens, len(ids)) <= budget:
        return [(0, len(ids))]  # the exact sizes are smaller still: the same answer
    return part_bounds(ctx.buffer.sample_bytes(ids), budget)


def _batch_part(ctx: Batching, msg: m.BatchRequest) -> m.Msg:
    """Part `msg.part` (> 0) of a recorded batch."""
    rec = ctx.buffer.recorded_ids(msg.policy, msg.step)
    bounds = _part_bounds(ctx, rec[0]) if rec is not None else []
    if rec is None or msg.part >= len(bounds):
        return m.Error(
            rid=msg.rid,
            code="bad_request",
            message=f"step {msg.step} of {msg.policy!r} has no recorded part {msg.part} ({len(bounds)} parts)",
        )
    a, b = bounds[msg.part]
    cols = ctx.buffer.columns(rec[0][a:b], rec[1][a:b])
    if ctx.pipeline.batch_level(msg.policy):  # normalised over the whole batch, not this part
        cols = ctx.pipeline.batch_columns(msg.policy, cols, ctx.buffer.advantages(rec[0]), a)
    return m.BatchReply(
        rid=msg.rid,
        policy=msg.policy,
        step=msg.step,
        columns=cols,
        ready=True,
        part=msg.part,
        parts=len(bounds),
    )


def batch_may_be_ready(ctx: Batching, parked: Parked) -> bool:
    """Whether the policy of a held BatchRequest has at least a batch's fresh sequences buffered."""
    policy = getattr(parked.msg, "policy", "")
    pol = ctx.policies.get(policy)
    if pol is None:
        return True  # answered with its error at once
    need = ctx.pipeline.fresh_per_batch(policy, pol.batch_prompts * pol.group_size)
    # checked after every accepted result: the count the buffer keeps, when it keeps one
    return ctx.buffer.buffered(policy) >= need

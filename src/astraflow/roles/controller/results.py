"""Results: a worker's TaskResult (one task) or TaskResults (a group commit) is checked against its
lease and its task, stored with the stage state it changed, and acknowledged; a failed attempt is
charged to the member and the task (docs/architecture.md, "Group commit")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from astraflow import log
from astraflow.dataflow import failures
from astraflow.dataflow.admission import Admission
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.column_intake import ingest_columns, plan_advantages
from astraflow.dataflow.evaluation import Evaluator
from astraflow.dataflow.limits import RefusedResult
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.stall import Progress
from astraflow.dataflow.validate import ResultChecker
from astraflow.protocol import messages as m
from astraflow.protocol.columns import ResultColumns
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.progress import made_progress
from astraflow.roles.controller.run_end import RunEnd, summary
from astraflow.roles.controller.task_queue import TaskShapes
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.state.ledger import Ledger, TaskRow
from astraflow.state.member_health import Kind
from astraflow.state.store import Store

_log = log.get("controller")


@dataclass(frozen=True, slots=True)
class Intake:
    """What taking a result reads and changes: the lease, the checks, the stage pipeline and buffer,
    the eval rounds, the member's record, the stall clock and the failure streak."""

    store: Store
    ledger: Ledger
    checker: ResultChecker
    admission: Admission
    shapes: TaskShapes
    pipeline: Pipeline
    buffer: Buffer
    evals: Evaluator | None
    accounting: MemberAccounting
    progress: Progress
    run: RunEnd


def on_task_result(ctx: Intake, member: dict[str, Any], msg: m.TaskResult) -> Outcome:
    """Validate the lease; store trajectories, advantages and filter outcomes durably; then ack (an
    accepted result is an event: a held batch request may now be ready)."""
    reply = _task_result(ctx, member, msg)
    accepted = isinstance(reply, m.ResultAck) and reply.status == "accepted"
    return Outcome(reply, (Event.RESULT_ACCEPTED,) if accepted else ())


def _task_result(ctx: Intake, member: dict[str, Any], msg: m.TaskResult) -> m.Msg:
    """The reply to one result, stored (or charged) as on_task_result says."""
    if msg.error:
        status = member_failed(ctx, member, msg.task_id, msg.epoch, msg.error[:8000], "failures")
        return m.ResultAck(
            rid=msg.rid,
            task_id=msg.task_id,
            status="failed" if status in ("requeued", "failed") else status,
        )
    task = ctx.ledger.get(msg.task_id)
    bad = _invalid(ctx, member, msg, task, None)
    if bad is not None:
        return m.Error(rid=msg.rid, code="bad_result", message=bad)
    try:
        with ctx.store.write():
            status = _store_result(ctx, member, msg, task)
            if status == "accepted" and task is not None:
                # stage state commits with the result that changed it: a kill -9 loses neither
                for pol in task.policies:
                    ctx.pipeline.save(pol)
    except RefusedResult as exc:
        # rolled back: nothing of the result is kept (advantages that do not fit a float)
        status = fail_attempt(ctx, member["id"], msg.task_id, msg.epoch, f"invalid result: {exc}")
        return m.Error(rid=msg.rid, code="bad_result", message=f"task {msg.task_id}: {exc} ({status})")
    return m.ResultAck(rid=msg.rid, task_id=msg.task_id, status=status)


def on_task_results(ctx: Intake, member: dict[str, Any], msg: m.TaskResults) -> Outcome:
    """Group commit: check every result, store the valid ones in one transaction (stage state saved
    once per policy), then ack each. The results are read from the message's columns; a message
    whose columns do not fit together is refused whole (nothing stored, the leases lapse). A result
    refused while stored rolls the group back, and each result is then handled alone, as a
    TaskResult would be."""
    return take_results(ctx, [member] * len(msg.results), msg)


def take_results(ctx: Intake, members: list[dict[str, Any]], msg: m.TaskResults) -> Outcome:
    """`on_task_results` of a message whose result i came from members[i] (several members' results
    read in one poll are taken as one message: coalesce.py); each result is checked against its own
    member's lease and charged to that member, as it would be in that member's own message."""
    view = ResultColumns(msg)
    if view.problem:
        return Outcome(m.Error(rid=msg.rid, code="bad_result", message=f"{view.problem}; nothing stored"))
    acks: dict[int, m.OutcomeAck] = {}
    good: list[tuple[int, m.ResultHead, TaskRow | None]] = []
    tasks = ctx.ledger.get_many(h.task_id for h in msg.results if not h.error)
    latest: dict[str, int] = {}
    cleared = _cleared(ctx, members, view, tasks, latest)
    expected: dict[tuple[Any, ...], dict[str, int]] = {}
    verdicts: dict[tuple[Any, ...], str] = {}
    for i, h in enumerate(msg.results):
        if h.error:
            failed = m.TaskResult(task_id=h.task_id, epoch=h.epoch, error=h.error)
            acks[i] = _outcome_ack(h.task_id, _task_result(ctx, members[i], failed))
            continue
        task = tasks.get(h.task_id)
        bad = _invalid_in(ctx, members[i], view, i, task, latest, cleared.get(i, False), expected, verdicts)
        if bad is not None:
            acks[i] = m.OutcomeAck(task_id=h.task_id, status="invalid", code="bad_result", message=bad)
        else:
            good.append((i, h, task))
    try:
        acks.update(_store_group(ctx, members, view, good))
    except RefusedResult:
        for i, h, _task in good:
            acks[i] = _outcome_ack(h.task_id, _task_result(ctx, members[i], _single(view.outcome(i))))
    accepted = any(a.status == "accepted" for a in acks.values())
    reply = m.ResultsAck(rid=msg.rid, acks=[acks[i] for i in range(len(msg.results))])
    return Outcome(reply, (Event.RESULT_ACCEPTED,) if accepted else ())


def _store_group(
    ctx: Intake,
    members: list[dict[str, Any]],
    view: ResultColumns,
    good: list[tuple[int, m.ResultHead, TaskRow | None]],
) -> dict[int, m.OutcomeAck]:
    """Store the checked results of one message in one transaction (stage state saved once per
    policy); their acks by result index. Raises RefusedResult, rolled back, when one is refused."""
    acks: dict[int, m.OutcomeAck] = {}
    # the groups of every result are written together when the block ends (dataflow/pending.py)
    with ctx.store.write(), ctx.buffer.grouped():
        fed: dict[str, None] = {}
        # every lease of the message completed by one read and one UPDATE (state/ledger.py)
        owners = [members[i]["id"] for i, _, _ in good]
        statuses = ctx.ledger.complete_many([(h.task_id, h.epoch) for _, h, _ in good], owners)
        # every one-group result's advantages in one pass over the message (the same values)
        planned = plan_advantages(ctx.pipeline, view)
        for (i, h, task), status in zip(good, statuses, strict=True):
            _take(ctx, members[i], (view, i), task, status, planned)
            acks[i] = m.OutcomeAck(task_id=h.task_id, status=status)
            if status == "accepted" and task is not None:
                fed.update(dict.fromkeys(task.policies))
        for pol in fed:
            ctx.pipeline.save(pol)
    return acks


def _checked(task: TaskRow | None, member: dict[str, Any]) -> bool:
    """Whether a result for this task is checked: a live lease of this member (a lapsed lease still
    accepts its owner's late result, so that one is checked too); any other is acknowledged unstored."""
    return task is not None and task.status in ("leased", "queued") and task.owner == member["id"]


def _latest(ctx: Intake, latest: dict[str, int]) -> dict[str, int]:
    """Every policy's newest version, read once per message into `latest`."""
    if not latest:
        latest.update({p["name"]: int(p["version"]) for p in ctx.store.policies()})
    return latest


def _cleared(
    ctx: Intake,
    members: list[dict[str, Any]],
    view: ResultColumns,
    tasks: dict[int, TaskRow],
    latest: dict[str, int],
) -> dict[int, bool]:
    """Result index -> whether its sequences passed the per-token checks together with the rest of
    the message's (ResultChecker.clear_columns); results not checked are left out."""
    heads = view.heads
    idx = [i for i, h in enumerate(heads) if not h.error and _checked(tasks.get(h.task_id), members[i])]
    if not idx:
        return {}
    picked = [(i, tasks[heads[i].task_id]) for i in idx]
    flags = ctx.checker.clear_columns(
        view, [(i, t.roles, ctx.shapes.sampling(t)) for i, t in picked], _latest(ctx, latest)
    )
    return dict(zip(idx, flags, strict=True))


def _invalid_in(
    ctx: Intake,
    member: dict[str, Any],
    view: ResultColumns,
    i: int,
    task: TaskRow | None,
    latest: dict[str, int],
    cleared: bool,
    expected: dict[tuple[Any, ...], dict[str, int]],
    verdicts: dict[tuple[Any, ...], str],
) -> str | None:
    """`_invalid` of result i of a message read through its columns: a cleared one's shape is read
    from the columns; one not cleared is turned back into an Outcome and walked, which names its
    fault. `expected` keeps the sequences per policy of each task shape over the message's results,
    `verdicts` the check of each shape of a cleared training result without infos."""
    if task is None or not _checked(task, member):
        return None
    if not cleared:
        return _invalid(ctx, member, view.outcome(i), task, latest)
    h = view.heads[i]
    a, b = view.starts[i], view.starts[i + 1]
    names = view.cols.names
    got: dict[str, int] = {}
    if b > a and view.uniform("policy")[i]:
        got[names[int(view.policy[a])]] = b - a
    else:
        for idx, n in enumerate(np.bincount(view.policy[a:b], minlength=len(names)).tolist()):
            if n:
                got[names[idx]] = got.get(names[idx], 0) + n
    # the verdict is a function of the shape alone: results of one shape (the usual message) ask once
    shape = None if h.infos or ctx.shapes.is_eval(task.id) else _shape_of(task, h.episodes, got)
    bad = None if shape is None else verdicts.get(shape)
    if bad is None:
        bad = ctx.checker.check_cleared(
            h.episodes,
            h.infos,
            got,
            expected=_expected(ctx, task, expected),
            roles=task.roles,
        )
        if shape is not None:
            verdicts[shape] = bad
    if not bad:
        return None
    status = member_failed(ctx, member, h.task_id, h.epoch, f"invalid result: {bad}", "invalid")
    return f"task {h.task_id}: {bad} ({status})"


def _shape_of(task: TaskRow, episodes: list[int], got: dict[str, int]) -> tuple[Any, ...]:
    """What `check_cleared` reads of a training result without infos: its role map, group size,
    episodes' sequence counts and sequences per policy."""
    return (tuple(task.roles.items()), task.group_size, tuple(episodes), tuple(got.items()))


def _expected(ctx: Intake, task: TaskRow, seen: dict[tuple[Any, ...], dict[str, int]]) -> dict[str, int]:
    """The sequences per policy a result of `task` must bring, found once per shape of a training
    task (role map, group size) in `seen`; an eval task's own."""
    if ctx.shapes.is_eval(task.id):
        return ctx.admission.task_sequences(task.roles, ctx.shapes.sizes(task))
    key = (tuple(task.roles.items()), task.group_size)
    got = seen.get(key)
    if got is None:
        got = seen[key] = ctx.admission.task_sequences(task.roles, ctx.shapes.sizes(task))
    return got


def _invalid(
    ctx: Intake,
    member: dict[str, Any],
    res: m.TaskResult | m.Outcome,
    task: TaskRow | None,
    latest: dict[str, int] | None,
    cleared: bool = False,
) -> str | None:
    """Why a result of a live lease of this member is refused (the attempt is charged), or None.
    `latest` caches the policies' versions over the results of one message; `cleared`: its sequences
    passed the per-token checks with the rest of its message."""
    if task is None or not _checked(task, member):
        return None
    latest = _latest(ctx, {} if latest is None else latest)
    sizes = ctx.shapes.sizes(task)
    bad = ctx.checker.check(
        res.episodes,
        expected=ctx.admission.task_sequences(task.roles, sizes),
        roles=task.roles,
        latest=latest,
        task_sampling=ctx.shapes.sampling(task),
        cleared=cleared,
    )
    if not bad:
        return None
    status = member_failed(ctx, member, res.task_id, res.epoch, f"invalid result: {bad}", "invalid")
    return f"task {res.task_id}: {bad} ({status})"


def _store_result(
    ctx: Intake, member: dict[str, Any], res: m.TaskResult | m.Outcome, task: TaskRow | None
) -> str:
    """Complete the task's lease and store what the result brings (inside the caller's transaction,
    which also saves the stage state of the task's policies); the status."""
    with ctx.store.write():
        status = ctx.ledger.complete(res.task_id, res.epoch, member["id"])
        _take(ctx, member, res, task, status)
    return status


def _take(
    ctx: Intake,
    member: dict[str, Any],
    res: m.TaskResult | m.Outcome | tuple[ResultColumns, int],
    task: TaskRow | None,
    status: str,
    planned: dict[int, list[float]] | None = None,
) -> None:
    """Store what a result (or result i of a message's columns) whose lease completed with `status`
    brings (inside the caller's transaction): an accepted one's sequences, or its eval round's record
    (`planned`: the advantages `plan_advantages` found for the message's results)."""
    if status != "accepted":
        return
    ctx.accounting.succeeded(member["id"])
    task_id = res[0].heads[res[1]].task_id if isinstance(res, tuple) else res.task_id
    if ctx.shapes.is_eval(task_id):
        assert ctx.evals is not None
        ctx.evals.record(task_id, res[0].outcome(res[1]).episodes if isinstance(res, tuple) else res.episodes)
    else:
        assert task is not None
        # decided when the task was leased: a done task keeps a full group of every policy it fed,
        # even when that policy's budget was taken while the task ran
        if isinstance(res, tuple):
            ingest_columns(
                ctx.pipeline,
                ctx.buffer,
                task.id,
                task.prompt_key,
                *res,
                read_only=task.read_only,
                planned=planned,
            )
        else:
            ctx.pipeline.ingest(ctx.buffer, task.id, task.prompt_key, res.episodes, read_only=task.read_only)
    made_progress(ctx.store, ctx.progress)


def member_failed(
    ctx: Intake, member: dict[str, Any], task_id: int, epoch: int, error: str, kind: Kind
) -> str:
    """A member's attempt failed: charge the member; the task too unless a healthy peer does far better."""
    task = ctx.ledger.get(task_id)
    if task is None or task.status != "leased" or task.epoch != epoch or task.owner != member["id"]:
        return fail_attempt(ctx, member["id"], task_id, epoch, error)  # not a live attempt of its own
    if ctx.accounting.failed(member, kind) or not ctx.ledger.give_back(task_id, epoch, member["id"]):
        return fail_attempt(ctx, member["id"], task_id, epoch, error)
    return "requeued"


def fail_attempt(ctx: Intake, member_id: str, task_id: int, epoch: int, error: str) -> str:
    """End a leased attempt with an error: count it by reason and end the run after too many failed tasks."""
    with ctx.store.write():
        status = ctx.ledger.fail(task_id, epoch, member_id, error)
        if status in ("requeued", "failed"):
            reason = failures.record(ctx.store, error)
            ctx.store.add_event("task_failed", f"task {task_id} on {member_id}: {reason}: {summary(error)}")
    if status in ("requeued", "failed"):
        _log.warning("task %d failed on %s (%s):\n%s", task_id, member_id, status, error[:8000])
        if status == "failed":
            ctx.run.check_failed_streak(error)
    return status


def _single(o: m.Outcome) -> m.TaskResult:
    """One result of a TaskResults as the TaskResult it stands for."""
    return m.TaskResult(task_id=o.task_id, epoch=o.epoch, episodes=o.episodes, error=o.error)


def _outcome_ack(task_id: int, reply: m.Msg) -> m.OutcomeAck:
    """The single-result path's reply (ResultAck or Error) as one result's OutcomeAck."""
    if isinstance(reply, m.ResultAck):
        return m.OutcomeAck(task_id=task_id, status=reply.status)
    if isinstance(reply, m.Error):
        return m.OutcomeAck(task_id=task_id, status="invalid", code=reply.code, message=reply.message)
    return m.OutcomeAck(task_id=task_id, status="invalid", code="internal", message=type(reply).__name__)

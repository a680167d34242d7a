"""Leasing: a worker's TaskRequest is answered with up to n admitted tasks it can serve (credit-based
flow control; docs/protocol.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from astraflow.dataflow.admission import Admission
from astraflow.dataflow.control import RunControl
from astraflow.dataflow.evaluation import Evaluator
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.roles.controller.core import RETRY_S
from astraflow.roles.controller.outcome import Outcome
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.run_end import RunEnd
from astraflow.roles.controller.task_queue import TaskQueue, TaskShapes
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.roles.member_table import MemberTable
from astraflow.state import tasks as tasks_q
from astraflow.state.ledger import Ledger, TaskRow
from astraflow.state.store import Store


@dataclass(frozen=True, slots=True)
class Leasing:
    """What a lease reads and changes: the ledger within admission, the member's share and table."""

    store: Store
    ledger: Ledger
    admission: Admission
    control: RunControl
    evals: Evaluator | None
    queue: TaskQueue
    shapes: TaskShapes
    members: MemberTable
    accounting: MemberAccounting
    draining: set[str]
    """Members asked to leave: they get no new tasks."""
    versions: PolicyVersions
    run: RunEnd
    group_sizes: dict[str, int]
    default_slots: int
    """rollout.slots: a member's share when it names none."""
    max_member_slots: int
    """controller.max_member_slots: the most tasks one member may hold."""


def on_task_request(ctx: Leasing, member: dict[str, Any], msg: m.TaskRequest) -> Outcome:
    """Lease up to n admitted tasks the member can serve (credit-based flow control); a lease
    causes no event (what it changes, the work in flight, no held request waits on)."""
    return Outcome(_lease(ctx, member, msg))


def _lease(ctx: Leasing, member: dict[str, Any], msg: m.TaskRequest) -> m.Msg:
    if ctx.run.stopping():
        return m.TaskGrant(rid=msg.rid, stop=True, versions=ctx.versions.latest())
    if member["id"] in ctx.draining:
        return m.Error(rid=msg.rid, code="draining", message="asked to leave: finish your tasks and say Bye")
    if not ctx.accounting.may_lease(member):
        ctx.members.touch(member["id"], time.time(), dict(msg.loaded) or None)
        return m.TaskGrant(rid=msg.rid, versions=ctx.versions.latest(), retry_after_s=RETRY_S)
    now = time.time()
    loaded = dict(msg.loaded)
    admit, admits_shape = _admission_filter(ctx, set(member["policies"]), loaded)
    adds: dict[tuple[Any, ...], Callable[[], None]] = {}

    def accept(task: TaskRow) -> bool:
        ok = admit(task)
        if ok:  # the ledger leases every task accepted: it is in flight for the next ones
            key = (tuple(task.roles.items()), task.group_size, tuple(task.read_only))
            add = adds.get(key)
            if add is None:
                add = adds[key] = ctx.admission.leased_adder(task.roles, task.group_size, task.read_only)
            add()
        return ok

    # the open tasks per shape are read once for the refill, the queue check and the work ahead,
    # then kept by the ledger's writes (state/open_shapes.py)
    with ctx.ledger.shapes.kept():
        ctx.queue.refill()
        ctx.members.touch(member["id"], now, loaded or None)
        with ctx.store.write():
            quota = authz.task_quota(
                ctx.store,
                member,
                msg.n,
                default_slots=ctx.default_slots,
                max_slots=ctx.max_member_slots,
            )
            n = ctx.accounting.quota(member, quota)
            with ctx.admission.leasing():
                # a request that would lease nothing (the common answer to a held one) reads no queued task
                leased = []
                if not _none_admitted(ctx, admits_shape):
                    leased = ctx.ledger.lease(member["id"], n, now, accept)
                finished: dict[tuple[str, ...], list[str]] = {}
                for t in leased:
                    # what the worker is told not to keep is what its result is stored by (results.py)
                    pols = tuple(dict.fromkeys(t.roles.values()))
                    done = finished.get(pols)
                    if done is None:
                        done = finished[pols] = ctx.admission.read_only(pols)
                    if done and not set(done) <= set(t.read_only):
                        ctx.ledger.set_read_only(t, set(t.read_only) | set(done))
    if leased:  # it beats at once, and at the recipe's interval while it holds them
        ctx.members.pace(member["id"], 1.0)
    tasks = [
        m.Task(
            task_id=t.id,
            epoch=t.epoch,
            sample=t.sample,
            group_size=t.group_size,
            roles=t.roles,
            group_sizes=sizes,
            read_only=t.read_only,
            sampling=sampling,
        )
        for t, (sizes, sampling) in zip(leased, _grant_shapes(ctx, leased), strict=True)
    ]
    return m.TaskGrant(
        rid=msg.rid,
        tasks=tasks,
        versions=ctx.versions.for_member(member),
        retry_after_s=0.0 if tasks else RETRY_S,
    )


def _grant_shapes(ctx: Leasing, leased: list[TaskRow]) -> list[tuple[dict[str, int], dict[str, float | int]]]:
    """(group sizes, sampling overrides) of each leased task, found once per shape of a training
    task (role map, group size): a grant's tasks share one or two shapes."""
    shapes = ctx.shapes
    seen: dict[tuple[Any, ...], tuple[dict[str, int], dict[str, float | int]]] = {}
    out = []
    for t in leased:
        if shapes.is_eval(t.id):
            out.append((shapes.sizes(t), shapes.sampling(t)))
            continue
        key = (tuple(t.roles.values()), t.group_size)
        got = seen.get(key)
        if got is None:
            got = seen[key] = (shapes.sizes(t), shapes.sampling(t))
        out.append(got)
    return out


def _none_admitted(ctx: Leasing, admits_shape: Callable[[dict[str, str], list[str]], bool]) -> bool:
    """True when no queued task can be leased in this call: no eval task is open (those are admitted
    by their round, not their shape) and every shape of the queued tasks is refused (one GROUP BY
    instead of reading the queue; an empty queue has no shape)."""
    if ctx.evals is not None and ctx.evals.open_tasks:
        return False
    return not any(
        admits_shape(roles, ro) for roles, _size, ro, _n in tasks_q.task_shapes(ctx.store, ("queued",))
    )


def _admission_filter(
    ctx: Leasing, serves: set[str], loaded: dict[str, int]
) -> tuple[Callable[[TaskRow], bool], Callable[[dict[str, str], list[str]], bool]]:
    """Whether a queued task may go to a worker serving `serves` and holding `loaded`, for one lease
    call; and whether a task shape (role map, read-only policies) may, for a task not of an eval round."""
    refused: set[tuple[Any, ...]] = set()
    bounds: dict[tuple[Any, ...], list[tuple[str, int]] | None] = {}
    """Per task shape (role map, read-only policies): the lease rule as bounds on the work ahead of
    each policy it feeds (`Admission.lease_bounds`), or None when the member, the operator's pauses,
    the budgets or the versions the member holds refuse it whatever is ahead. Found once a call."""
    evals, admission = ctx.evals, ctx.admission
    ahead = admission.ahead

    def admits_shape(roles: dict[str, str], read_only: list[str]) -> bool:
        # Within one lease call every lease only adds work ahead, so a task shape (its role map and
        # the policies it feeds; the group sizes are the recipe's) refused once stays refused: later
        # queued tasks of that shape are skipped without counting their sequences or asking the store.
        key = (tuple(roles.items()), tuple(read_only))
        if key in refused:
            return False
        if key in bounds:
            got = bounds[key]
        else:
            pols = list(dict.fromkeys(roles.values()))
            feeds = [p for p in pols if p not in read_only]
            # a task that feeds no policy still training would be run only to be thrown away
            static = (
                (not serves or serves.issuperset(pols))
                and ctx.control.may_lease(feeds)
                and bool(admission.active(feeds))
            )
            got = bounds[key] = (
                admission.lease_bounds(loaded, feeds, admission.task_sequences(roles, ctx.group_sizes))
                if static
                else None
            )
        ok = got is not None and all(ahead(p) <= most for p, most in got)
        if not ok:
            refused.add(key)
        return ok

    def admit(task: TaskRow) -> bool:
        if evals is not None and evals.is_eval(task.id):
            return (not serves or serves.issuperset(task.policies)) and evals.may_lease(task, loaded)
        return admits_shape(task.roles, task.read_only)

    return admit, admits_shape

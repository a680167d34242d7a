"""Leasing: a worker's TaskRequest is answered with up to n admitted tasks it can serve (credit-based
flow control; docs/protocol.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.roles.controller.core import RETRY_S, ControllerCore
from astraflow.roles.controller.outcome import Outcome
from astraflow.state.ledger import TaskRow


def on_task_request(ctl: ControllerCore, member: dict[str, Any], msg: m.TaskRequest) -> Outcome:
    """Lease up to n admitted tasks the member can serve (credit-based flow control); a lease
    causes no event (what it changes, the work in flight, no held request waits on)."""
    return Outcome(_lease(ctl, member, msg))


def _lease(ctl: ControllerCore, member: dict[str, Any], msg: m.TaskRequest) -> m.Msg:
    if ctl.stopping():
        return m.TaskGrant(rid=msg.rid, stop=True, versions=ctl.versions())
    if member["id"] in ctl.draining:
        return m.Error(rid=msg.rid, code="draining", message="asked to leave: finish your tasks and say Bye")
    if not ctl.accounting.may_lease(member):
        ctl.members.touch(member["id"], time.time(), dict(msg.loaded) or None)
        return m.TaskGrant(rid=msg.rid, versions=ctl.versions(), retry_after_s=RETRY_S)
    now = time.time()
    loaded = dict(msg.loaded)
    admit = _admission_filter(ctl, set(member["policies"]), loaded)

    def accept(task: TaskRow) -> bool:
        ok = admit(task)
        if ok:  # the ledger leases every task accepted: it is in flight for the next ones
            ctl.admission.leased(task.roles, task.group_size, task.read_only)
        return ok

    ctl.refill()
    ctl.members.touch(member["id"], now, loaded or None)
    with ctl.store.write():
        quota = authz.task_quota(
            ctl.store,
            member,
            msg.n,
            default_slots=ctl.recipe.rollout.slots,
            max_slots=ctl.recipe.controller.max_member_slots,
        )
        n = ctl.accounting.quota(member, quota)
        with ctl.admission.leasing():
            leased = ctl.ledger.lease(member["id"], n, now, accept)
        for t in leased:
            # what the worker is told not to keep is what its result is stored by (results.py)
            read_only = set(t.read_only) | set(ctl.admission.read_only(t.policies))
            if read_only != set(t.read_only):
                ctl.ledger.set_read_only(t, read_only)
    tasks = [
        m.Task(
            task_id=t.id,
            epoch=t.epoch,
            sample=t.sample,
            group_size=t.group_size,
            roles=t.roles,
            group_sizes=ctl.task_sizes(t),
            read_only=t.read_only,
            sampling=ctl.task_sampling(t),
        )
        for t in leased
    ]
    return m.TaskGrant(
        rid=msg.rid,
        tasks=tasks,
        versions=ctl.versions_for(member),
        retry_after_s=0.0 if tasks else RETRY_S,
    )


def _admission_filter(
    ctl: ControllerCore, serves: set[str], loaded: dict[str, int]
) -> Callable[[TaskRow], bool]:
    """Whether a queued task may go to a worker serving `serves` and holding `loaded`, for one lease call."""
    refused: set[tuple[Any, ...]] = set()

    def admit(task: TaskRow) -> bool:
        pols = task.policies
        if ctl.evals is not None and ctl.evals.is_eval(task.id):
            return (not serves or serves.issuperset(pols)) and ctl.evals.may_lease(task, loaded)
        feeds = [p for p in pols if p not in task.read_only]
        per = ctl.admission.task_sequences(task.roles, ctl.group_sizes)
        # Within one lease call every lease only adds work ahead, so a task shape refused once
        # stays refused: later queued tasks of that shape are skipped without asking the store.
        key = (tuple(pols), tuple(feeds), tuple(sorted(per.items())))
        if key in refused:
            return False
        # a task that feeds no policy still training would be run only to be thrown away
        ok = (
            (not serves or serves.issuperset(pols))
            and ctl.control.may_lease(feeds)
            and bool(ctl.admission.active(feeds))
            and ctl.admission.may_lease(loaded, feeds, per)
        )
        if not ok:
            refused.add(key)
        return ok

    return admit

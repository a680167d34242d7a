"""Stall detection: when the run stops moving, say which policy waits on what.

Progress is any accepted task result, any newly recorded batch or any published version. When none
happened for `controller.stall_warn_s`, the controller logs one line per waiting policy, records a
`stall` event (status shows it) and repeats every stall_warn_s; after `controller.stall_fail_s` it
stops with exit code 1, so `astraflow up` exits 1 instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from astraflow.state.tasks import newest_open_error

if TYPE_CHECKING:
    from astraflow.config.recipe import Recipe
    from astraflow.dataflow.admission import Admission
    from astraflow.dataflow.buffer import Buffer
    from astraflow.state.ledger import Ledger
    from astraflow.state.store import Store


@dataclass
class Progress:
    """When the run last moved, and when the current stall was last reported."""

    last: float
    warned_at: float | None = None


class HasStore(Protocol):
    """What the last task failure is read from."""

    @property
    def store(self) -> Store: ...


class StallView(HasStore, Protocol):
    """What a stall report reads of the controller's state (roles/controller/core.py), and nothing more."""

    @property
    def recipe(self) -> Recipe: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def buffer(self) -> Buffer: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def roles(self) -> dict[str, str]: ...
    @property
    def group_sizes(self) -> dict[str, int]: ...
    @property
    def task_policies(self) -> list[str]: ...


def policy_wait(ctl: StallView, policy: str) -> str:
    """What one trainable, unfinished policy waits on, in words."""
    adm = ctl.admission
    pol = ctl.recipe.get_policy(policy)
    row = ctl.store.policy(policy)
    step, budget = int(row["step"]), ctl.recipe.budget(policy)
    taken, published = adm.taken(policy), adm.published(policy)
    if taken > published:
        return f"step {taken}/{budget}: its trainer took the batch and has not published version {taken}"
    batch = adm.limits[policy].batch_size
    buffered = ctl.buffer.counts(policy)["buffered"]
    if buffered >= batch:
        return (
            f"step {step}/{budget}: {buffered} sequences buffered (batch {batch}) but its trainer has not "
            "asked for the batch (is a trainer for it running?)"
        )
    tasks = ctl.ledger.counts()
    queued, leased = int(tasks.get("queued", 0)), int(tasks.get("leased", 0))
    parts = [f"step {step}/{budget}: needs {batch - buffered} more sequences ({buffered} buffered)"]
    raas = [mem for mem in ctl.store.members("alive") if mem["role"] == "raas"]
    serving = [mem for mem in raas if not mem["policies"] or policy in mem["policies"]]
    if queued and not serving:
        parts.append(f"{queued} tasks queued but no alive RaaS serves {policy!r}")
    elif queued and not leased:
        need = adm.target_version(policy) - (0 if ctl.recipe.run.mode == "sync" else pol.max_staleness)
        loaded = sorted({int(mem["loaded"].get(policy, 0)) for mem in serving})
        if loaded and max(loaded) >= need:
            # the versions are fine: the workers have not asked (still loading models at start-up?)
            parts.append(f"{queued} tasks queued, none leased: no serving RaaS asked for tasks")
        else:
            parts.append(
                f"{queued} tasks queued, none leasable: workers hold versions {loaded} of {policy!r}, "
                f"admission needs about {max(0, need)}"
            )
    elif leased:
        parts.append(f"{leased} tasks in flight")
    else:
        n = adm.tasks_to_admit(ctl.roles, ctl.group_sizes)
        if n <= 0:
            others = [p for p in adm.active(ctl.task_policies) if p != policy]
            why = f"another policy of the task has no room ({', '.join(others)})" if others else "no room"
            if ctl.recipe.workflow.after_budget == "stop" and len(adm.active(ctl.task_policies)) < len(
                [p for p in ctl.task_policies if ctl.recipe.get_policy(p).trainable]
            ):
                why = "a policy of the workflow met its budget and workflow.after_budget = 'stop'"
            parts.append(f"admission holds new tasks: {why}")
        elif policy not in ctl.task_policies:
            parts.append("no workflow role maps to it")
    failure = last_task_failure(ctl)
    if failure:
        parts.append(f"last task failure: {failure}")
    return "; ".join(parts)


def last_task_failure(ctl: HasStore) -> str:
    """The first line of the newest task error still on a queued or leased task ('' if none): a
    workflow whose every result is refused (e.g. more sequences than it declares) stalls the run, and
    this says why where the stall is reported."""
    lines = [ln for ln in newest_open_error(ctl.store).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def stall_report(ctl: StallView, idle_s: float) -> dict[str, Any]:
    """{idle_s, waits: policy -> reason} for every trainable policy that has not met its budget."""
    steps = {p["name"]: int(p["step"]) for p in ctl.store.policies()}
    waits = {
        p.name: policy_wait(ctl, p.name)
        for p in ctl.recipe.trainable()
        if steps.get(p.name, 0) < ctl.recipe.budget(p.name)
    }
    return {"idle_s": round(idle_s, 1), "waits": waits}

"""Admission: the one place that decides how much work is queued and who may lease it, per policy.

Why (B = fresh sequences a batch of the policy consumes, S = its staleness bound; the weights after
step k are version k, and step k trains on version k-1):

A sample generated under version v may be consumed by steps up to v + S + 1. When it is admitted,
`outstanding` sequences (buffered + in flight + queued) are ahead of it, and `c` steps have already
taken their batches, so it is consumed at about step c + floor(outstanding / B) + 1. The bound
holds whenever

    floor(outstanding / B) <= S   and   v >= c + floor(outstanding / B) - S.

The first condition is the production cap `outstanding < (S + 1) * B`: more queued work than
S + 1 batches could only be trained on by weights more than S versions newer than today's, so it
would expire. The second is the lease rule: a worker is leased tasks only while the version it
has loaded is at least `target + floor((ahead + k - 1) / B) - S`, where ahead = buffered + in-flight
sequences (the queued tasks behind the one being leased do not count), k the sequences the task adds
(so its last sequence is within the bound too), and target = max(published version, steps already taken)
(a step that took its batch but has not published yet still moves the goal post: its weights will
be the ones the next batch trains on). With S = 0 this is synchronous RL for that policy.

Several policies: every rule is per policy, with the policy's own B, S and step budget. A task's
workflow roles call several policies; the task *feeds* those of them that can take its output when it
is admitted (active, with room under their cap), and is read-only for the others: their sequences are
generated (the workflow needs them) but not kept, and do not count against their cap. A task is
admitted while at least one active policy it calls has room, and leased only to a worker whose loaded
versions satisfy the lease rule of every policy it feeds. A policy is active while it is trainable and
has not taken its budget's last batch: a frozen or finished policy never holds anything back. So a
slow policy takes what it can train on within its bound and a fast one is never held to its pace.
With `workflow.after_budget = "stop"`, a task whose trainable policy finished is not admitted at all.

`run.mode = "sync"` replaces the cap by rounds, lock-step across policies: a round (enough tasks for
one batch of the neediest active policy; each policy is fed only the tasks its own batch needs and is
read-only in the others, so it trains exactly once a round) is admitted only when no task is queued or in flight, no
active policy holds a full batch it has not taken, and every active policy published the version of
every batch it took; a task is leased only to a worker holding every active policy's newest version.

The `admission` data stages (e.g. `staleness`, which tightens S) are asked here too, through the
pipeline, in groups; `OFFER_FACTOR` bounds how many prompts the curators may skip per admitted one.

What it does not cover: a result can still arrive late (slow worker, lease expiry), and filters
can drop groups so the queue refills; the buffer's staleness check at batch time stays the
final guard. Sequences per task come from the workflow (`Workflow.sequences_per_task`; by default
each role yields its policy's group size).

Over 400 lines because the rules above are one piece: the production cap, the lease rule and the
several-policy rules read the same counts, and splitting them would spread one invariant over files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.dataflow.pipeline import Pipeline
from astraflow.state import batches, tasks, trajectories, versions
from astraflow.state.store import Store

OFFER_FACTOR = 4
"""Prompts the curators may be offered per task to admit (at least OFFER_MIN), so a curator that skips
most prompts cannot spin the controller."""
OFFER_MIN = 64


@dataclass(frozen=True)
class PolicyLimits:
    """What admission needs to know of one policy."""

    batch_size: int
    """Fresh sequences per batch (batch_prompts * group_size, less what replay takes)."""
    max_staleness: int
    """S of the policy (the tighter of its own bound and its admission stages')."""
    budget: int | None = None
    """Step budget; None = unbounded."""
    trainable: bool = True
    """False for a frozen policy: never waited on, nothing of it is kept."""


Shape = Callable[[dict[str, str], dict[str, int]], dict[str, int]]
"""(roles, group sizes by policy) -> expected sequences per policy of one task."""


def default_shape(roles: dict[str, str], group_sizes: dict[str, int]) -> dict[str, int]:
    """Each role yields its policy's group size of sequences."""
    out: dict[str, int] = {}
    for pol in roles.values():
        out[pol] = out.get(pol, 0) + group_sizes.get(pol, 1)
    return out


class KeptCounts(Protocol):
    """The buffered trajectories of a policy as the buffer keeps them in memory (None when it does
    not keep them yet: then the store counts them)."""

    def kept_buffered(self, policy: str) -> int | None:
        """Buffered trajectories of the policy."""
        ...

    def kept_groups(self, policy: str) -> int | None:
        """Tasks the policy's buffered trajectories came from."""
        ...


class Admission:
    """Caps queued + in-flight + buffered work per policy and gates leases on loaded versions."""

    def __init__(
        self,
        store: Store,
        limits: dict[str, PolicyLimits],
        *,
        mode: str = "async",
        after_budget: str = "serve",
        shape: Shape = default_shape,
        group_room: Callable[[str, int], int] | None = None,
        group_sizes: dict[str, int] | None = None,
        kept: KeptCounts | None = None,
    ) -> None:
        self.store = store
        self.kept = kept
        """The buffer's counts of buffered trajectories, read instead of the store's when it has them."""
        self.limits = limits
        self.mode = mode
        self.after_budget = after_budget
        self.shape = shape
        self.group_room = group_room
        """(policy, outstanding groups) -> groups its admission stages still allow."""
        self.group_sizes = dict(group_sizes or {})
        """Policy -> group size (the recipe's); a task row's group_size stands in for others."""
        self._leasing = False
        self._ahead: dict[str, int] | None = None
        """Inside `leasing()`: `ahead` per policy, read once when first asked and then kept up to
        date by `leased`."""
        self._steps: dict[tuple[str, str], int] = {}
        """Inside `leasing()`: (what, policy) -> steps taken or version published, read once a call."""
        self._unwritten: dict[str, int] = {}
        """Inside `leasing()`, before `ahead` was first counted: what the call's leases so far add to
        it (the ledger writes a call's leases when it ends, so the store does not count them yet)."""

    # ----- counting ---------------------------------------------------------------------------------

    @staticmethod
    def sequences_per_task(roles: dict[str, str], group_size: int | dict[str, int]) -> dict[str, int]:
        """Expected sequences a task yields per policy under the default shape."""
        sizes = group_size if isinstance(group_size, dict) else dict.fromkeys(roles.values(), group_size)
        return default_shape(roles, sizes)

    def task_sequences(self, roles: dict[str, str], group_size: int | dict[str, int]) -> dict[str, int]:
        """Expected sequences a task yields per policy (the workflow's shape)."""
        sizes = group_size if isinstance(group_size, dict) else dict.fromkeys(roles.values(), group_size)
        return self.shape(roles, sizes)

    def _sequences(self, task_statuses: tuple[str, ...]) -> dict[str, int]:
        """Per policy: buffered trajectories + expected sequences of tasks in these statuses."""
        out = dict.fromkeys(self.limits, 0)
        for pol, n in self._buffered(False).items():
            if pol in out:
                out[pol] += n
        for roles, group_size, read_only, n in tasks.task_shapes(self.store, task_statuses):
            skip = set(read_only)
            for pol, k in self.task_sequences(roles, self._sizes(roles, group_size)).items():
                if pol in out and pol not in skip:
                    out[pol] += k * n
        return out

    def _buffered(self, groups: bool) -> dict[str, int]:
        """Per policy: buffered trajectories (`groups`: the tasks they came from), as the buffer keeps
        them when it does for every policy, else counted by the store (a GROUP BY over the buffered)."""
        if self.kept is not None:
            count = self.kept.kept_groups if groups else self.kept.kept_buffered
            kept = {p: count(p) for p in self.limits}
            if all(n is not None for n in kept.values()):
                return {p: n for p, n in kept.items() if n is not None}
        if groups:
            return trajectories.buffered_groups_by_policy(self.store)
        return trajectories.buffered_by_policy(self.store)

    def _sizes(self, roles: dict[str, str], fallback: int) -> dict[str, int]:
        """Group size of every policy of a task: the recipe's, else the task row's."""
        return {p: int(self.group_sizes.get(p, fallback)) for p in roles.values()}

    def outstanding(self) -> dict[str, int]:
        """Per policy: buffered trajectories + expected sequences of queued and leased tasks."""
        return self._sequences(("queued", "leased"))

    def outstanding_groups(self) -> dict[str, int]:
        """Per policy, in groups (prompts): tasks queued or leased + tasks with buffered trajectories."""
        out = dict.fromkeys(self.limits, 0)
        for pol, n in self._buffered(True).items():
            if pol in out:
                out[pol] += n
        for roles, read_only, n in tasks.open_task_roles(self.store):
            for pol in set(roles.values()) - set(read_only):
                if pol in out:
                    out[pol] += n
        return out

    def cap(self, policy: str) -> int:
        """Most outstanding sequences allowed: (S + 1) * B."""
        lim = self.limits[policy]
        return (lim.max_staleness + 1) * lim.batch_size

    def taken(self, policy: str) -> int:
        """Steps whose batch was taken."""
        if self._leasing and ("taken", policy) in self._steps:
            return self._steps[("taken", policy)]
        n = batches.last_batch_step(self.store, policy)
        if self._leasing:
            self._steps[("taken", policy)] = n
        return n

    def published(self, policy: str) -> int:
        """The policy's newest published version (0 before its first step)."""
        if self._leasing and ("published", policy) in self._steps:
            return self._steps[("published", policy)]
        v = versions.published_version(self.store, policy)
        if self._leasing:
            self._steps[("published", policy)] = v
        return v

    def target_version(self, policy: str) -> int:
        """max(published version, steps whose batch was taken): the version the next batch trains on at least."""
        return max(self.published(policy), self.taken(policy))

    def ahead(self, policy: str) -> int:
        """Sequences that will be consumed before a task leased now: buffered + in flight."""
        if not self._leasing:
            return self._sequences(("leased",)).get(policy, 0)
        if self._ahead is None:
            self._ahead = self._sequences(("leased",))
            for pol, k in self._unwritten.items():
                if pol in self._ahead:
                    self._ahead[pol] += k
        return self._ahead.get(policy, 0)

    @contextmanager
    def leasing(self) -> Iterator[None]:
        """One lease call: `ahead` is counted from the store once (two GROUP BY queries over the
        buffered trajectories and the leased tasks) and then advanced by `leased` for every task the
        call leases, instead of being counted again for each task: with thousands of tasks in flight
        that count was the cost of a lease. The steps taken and versions published are read once too
        (no batch is taken and no version published while a lease call runs)."""
        self._leasing, self._ahead = True, None
        self._steps.clear()
        self._unwritten.clear()
        try:
            yield
        finally:
            self._leasing, self._ahead = False, None
            self._steps.clear()
            self._unwritten.clear()

    def leased(self, roles: dict[str, str], group_size: int, read_only: Iterable[str]) -> None:
        """A task was just leased inside `leasing()`: what it adds to `ahead`, counted as `_sequences`
        does (the ledger writes the call's leases only when it ends: `ahead` adds them, counted or not)."""
        self.leased_adder(roles, group_size, read_only)()

    def leased_adder(
        self, roles: dict[str, str], group_size: int, read_only: Iterable[str]
    ) -> Callable[[], None]:
        """`leased` of a task of this shape, its sequences counted once: a lease call takes many
        tasks of one shape."""
        skip = set(read_only)
        adds = [
            (pol, k)
            for pol, k in self.task_sequences(roles, self._sizes(roles, group_size)).items()
            if pol not in skip
        ]

        def add() -> None:
            for pol, k in adds:
                if self._ahead is None:
                    self._unwritten[pol] = self._unwritten.get(pol, 0) + k
                elif pol in self._ahead:
                    self._ahead[pol] += k

        return add

    # ----- who is still waited on -------------------------------------------------------------------

    def finished(self, policy: str) -> bool:
        """True once the policy took the batch of its last budgeted step (or it is frozen)."""
        lim = self.limits.get(policy)
        if lim is None or not lim.trainable:
            return True
        return lim.budget is not None and self.taken(policy) >= lim.budget

    def active(self, policies: Iterable[str]) -> list[str]:
        """The trainable, unfinished policies among these: the only ones admission waits on."""
        return [p for p in dict.fromkeys(policies) if p in self.limits and not self.finished(p)]

    def read_only(self, policies: Iterable[str]) -> list[str]:
        """Policies among these whose sequences are not kept (frozen, or budget taken)."""
        return [p for p in dict.fromkeys(policies) if self.finished(p)]

    # ----- admission --------------------------------------------------------------------------------

    def tasks_to_admit(self, roles: dict[str, str], group_size: int | dict[str, int]) -> int:
        """How many more tasks of this shape may be queued now (see `plan`)."""
        return len(self.plan(roles, group_size))

    def plan(self, roles: dict[str, str], group_size: int | dict[str, int]) -> list[list[str]]:
        """The tasks to queue now, each as the active policies it feeds (the task's other policies are
        read-only for it). Each active policy has room for some whole tasks; a task is queued while one
        of them still has room, and feeds exactly those that do, so a slow policy (full buffer) never
        holds back a fast one. In sync mode a round feeds each active policy just its batch's tasks."""
        pols = list(dict.fromkeys(roles.values()))
        active = self.active(pols)
        if not active:
            return []
        if self.after_budget == "stop" and any(
            p in self.limits and self.limits[p].trainable and p not in active for p in pols
        ):
            return []
        per = self.task_sequences(roles, group_size)
        out = self.outstanding()
        if self.mode == "sync":
            need = self._sync_need(active, per, out)
            return [[p for p in active if need[p] > i] for i in range(max(need.values(), default=0))]
        rooms = {p: self._async_room(p, per, out) for p in active}
        if self.group_room is not None:
            groups = self.outstanding_groups()
            for p in active:
                rooms[p] = min(rooms[p], max(0, self.group_room(p, groups.get(p, 0))))
        return [[p for p in active if rooms[p] > i] for i in range(max(rooms.values(), default=0))]

    def room(self, roles: dict[str, str], group_size: int | dict[str, int]) -> dict[str, int]:
        """Tasks of this shape each policy could still be fed now (what `plan` would queue for it;
        0 for a frozen or finished policy)."""
        plan = self.plan(roles, group_size)
        return {p: sum(p in feeds for feeds in plan) for p in self.limits}

    def _async_room(self, pol: str, per: dict[str, int], out: dict[str, int]) -> int:
        """Whole tasks the policy can still take under its cap (S + 1) * B."""
        k = per.get(pol, 0)
        if k <= 0:
            return 0
        # whole tasks that fit under the cap; rounding up would overshoot it by up to a group, and
        # that overshoot is consumed a version too late (it expired under replay's odd batch sizes).
        # With nothing outstanding, one task always goes, so a cap smaller than a group cannot stall.
        n = max(0, self.cap(pol) - out[pol]) // k
        return 1 if n == 0 and out[pol] == 0 else n

    def _sync_need(self, active: list[str], per: dict[str, int], out: dict[str, int]) -> dict[str, int]:
        """Tasks each active policy needs for one batch, when the previous round is trained on and
        published by every active policy (else none). Each policy is fed only the tasks its batch needs
        (read-only in the rest of the round): feeding every task of the round to every policy gave a
        policy with a smaller batch two batches a round, the second trained one version late."""
        none = dict.fromkeys(active, 0)
        if tasks.open_task_count(self.store):
            return none
        need = dict(none)
        for pol in active:
            lim = self.limits[pol]
            if out[pol] >= lim.batch_size or self.published(pol) < self.taken(pol):
                return none  # that policy still trains on the last round
            k = per.get(pol, 0)
            if k > 0:
                need[pol] = -(-(lim.batch_size - out[pol]) // k)
        return need

    def offer_limit(self, n: int) -> int:
        """Prompts the curators may be offered to queue n tasks."""
        return max(OFFER_FACTOR * n, OFFER_MIN)

    def may_lease(
        self, loaded: dict[str, int], policies: Iterable[str], task_sequences: dict[str, int] | None = None
    ) -> bool:
        """True if the worker's loaded version v of every active policy satisfies
        v >= target + floor((ahead + k - 1) / B) - S, with k the sequences this task adds (unknown
        loaded counts as 0): the task's last sequence is still consumed within the bound. Counting k
        matters when B is not a multiple of the group size (replay makes a batch's fresh part odd).
        In sync mode: v >= target (the newest weights of every active policy). The rule is kept once,
        as `lease_bounds` (what a lease call checks per task)."""
        bounds = self.lease_bounds(loaded, policies, task_sequences)
        return bounds is not None and all(self.ahead(pol) <= most for pol, most in bounds)

    def lease_bounds(
        self, loaded: dict[str, int], policies: Iterable[str], task_sequences: dict[str, int] | None = None
    ) -> list[tuple[str, int]] | None:
        """`may_lease` for every task of one shape within one lease call (`leasing()`: the targets,
        the active policies and the loaded versions do not change in it; only `ahead` grows): per
        active policy, the most sequences ahead of the task for which it may be leased, since
        floor((ahead + k - 1) / B) <= v - target + S  <=>  ahead <= (v - target + S + 1) * B - k.
        A task of the shape may be leased while `ahead(p) <= bound` for every (p, bound); None when
        none may be in this call (sync mode: the worker lacks a newest version)."""
        out: list[tuple[str, int]] = []
        for pol in self.active(policies):
            lim = self.limits[pol]
            v = loaded.get(pol, 0)
            if self.mode == "sync":
                if v < self.target_version(pol):
                    return None
                continue
            if lim.batch_size <= 0:
                raise ZeroDivisionError(f"policy {pol!r}: a batch of {lim.batch_size} fresh sequences")
            k = max(1, (task_sequences or {}).get(pol, 1))
            out.append((pol, (v - self.target_version(pol) + lim.max_staleness + 1) * lim.batch_size - k))
        return out


@dataclass(frozen=True)
class AdmissionSections:
    """The recipe's sections admission reads, and nothing else of it."""

    mode: str
    """`run.mode`: "async" (each policy within its bound) or "sync" (rounds in lock-step)."""
    workflow: str
    """`workflow.name`: the workflow whose `sequences_per_task` gives a task's shape."""
    after_budget: str
    """`workflow.after_budget`: whether a task of a finished policy is still admitted."""
    policies: list[PolicyConfig]
    """Every `[[policy]]` section: batch size, group size, staleness bound, trainable."""
    budgets: dict[str, int]
    """Policy name -> step budget (0 for a frozen policy)."""

    @classmethod
    def of(cls, recipe: Recipe) -> AdmissionSections:
        """The sections of a validated recipe."""
        return cls(
            mode=recipe.run.mode,
            workflow=recipe.workflow.name,
            after_budget=recipe.workflow.after_budget,
            policies=list(recipe.policy),
            budgets={p.name: recipe.budget(p.name) for p in recipe.policy},
        )


def admission_for(
    sections: AdmissionSections,
    store: Store,
    pipeline: Pipeline,
    roles: dict[str, str],
    kept: KeptCounts | None = None,
) -> Admission:
    """The run's admission: every policy's limits from its section, the workflow's task shape, the
    pipeline's admission stages (their bound tightens S; their group budget is asked too)."""
    from astraflow import plugins

    wf_cls = plugins.load("workflows", sections.workflow)
    limits: dict[str, PolicyLimits] = {}
    for p in sections.policies:
        # with replay, a batch consumes only its fresh part: admit for that rate, or work expires
        fresh = pipeline.fresh_per_batch(p.name, p.batch_prompts * p.group_size)
        limits[p.name] = PolicyLimits(
            fresh, pipeline.max_staleness(p.name), sections.budgets[p.name] or None, p.trainable
        )

    def shape(task_roles: dict[str, str], group_sizes: dict[str, int]) -> dict[str, int]:
        per_role = wf_cls.sequences_per_task({r: group_sizes.get(p, 1) for r, p in task_roles.items()})
        out: dict[str, int] = {}
        for r, p in task_roles.items():
            out[p] = out.get(p, 0) + int(per_role.get(r, 0))
        return out

    if getattr(wf_cls, "baseline_per_role", True):
        counts: dict[str, int] = {}
        for name in roles.values():
            counts[name] = counts.get(name, 0) + 1
        pipeline.split_roles = {p for p, n in counts.items() if n > 1}
    return Admission(
        store,
        limits,
        mode=sections.mode,
        after_budget=sections.after_budget,
        shape=shape,
        group_room=pipeline.group_room,
        group_sizes={p.name: p.group_size for p in sections.policies},
        kept=kept,
    )

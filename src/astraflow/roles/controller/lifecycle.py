"""The run's life: start (or resume) it, the periodic work between polls (liveness, lease expiry,
queue refill, eval rounds, the end of the run), stalls and when the loop may exit (a failure streak
ends the run through run_end.py).

Like the message handlers, these take only the parts they read and change, built once by `Controller`
(service.py): `start` a `Starting`, the rest a `Ticking`. What the loop keeps between rounds (whether to
stop and with which exit code, when it last ticked and pruned) is a `LoopState`; the held requests stay
the IO side's (`tick` returns the members it declared dead, whose held requests die with them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from astraflow import log
from astraflow.config.recipe import Recipe
from astraflow.dataflow import failures
from astraflow.dataflow.admission import Admission
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.control import RunControl
from astraflow.dataflow.evaluation import Evaluator
from astraflow.dataflow.poisoned import drop_poisoned
from astraflow.dataflow.stall import Progress, stall_report
from astraflow.metrics.sinks import Sinks
from astraflow.roles import authz
from astraflow.roles.controller.beat_pace import CHANGE, BeatPace, idle_interval, timeout_scale
from astraflow.roles.controller.core import settle_heap
from astraflow.roles.controller.metrics_row import emit, rewrite_lost_rows
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.progress import made_progress
from astraflow.roles.controller.run_end import RunEnd
from astraflow.roles.controller.task_queue import TaskQueue
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.roles.member_table import MemberTable
from astraflow.state import members
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store

_log = log.get("controller")

PRUNE_EVERY_S = 2.0
"""Seconds between passes that delete long-dead members."""


@dataclass
class LoopState:
    """What the controller's loop keeps between rounds: a signal or a stall sets `stop_requested`."""

    stop_requested: bool = False
    exit_code: int = 0
    """What the controller exits with unless the run failed (1 after a stall past stall_fail_s)."""
    last_tick: float = 0.0
    last_prune: float = 0.0
    backlogged: bool = False
    """The last poll left messages unread: no member is declared dead until they are read (a
    controller behind its input must not take its own lag for its members' silence)."""
    settled_members: int = 0
    """Members alive when the heap was last settled (core.settle_heap); 0: this process does not
    settle it (only the controller's own process does: run_controller sets it)."""


@dataclass(frozen=True, slots=True)
class Starting:
    """What starting (or resuming) the run reads and changes: the stored recipe and run, the policies'
    rows, the member table, the eval rounds, the metrics rows a kill kept from the sinks, the queue."""

    recipe: Recipe
    """The whole recipe: it is what the run stores and what a restart is checked against."""
    allow_recipe_change: bool
    store: Store
    members: MemberTable
    evals: Evaluator | None
    sinks: Sinks
    run: RunEnd
    queue: TaskQueue
    run_dir: Path


@dataclass(frozen=True, slots=True)
class Stalls:
    """What a stall check reads (the `StallView` of dataflow/stall.py) and the stall clock and limits."""

    recipe: Recipe
    """Read by the stall report: the policies' budgets and staleness, the run mode, the workflow."""
    store: Store
    admission: Admission
    buffer: Buffer
    ledger: Ledger
    roles: dict[str, str]
    group_sizes: dict[str, int]
    task_policies: list[str]
    progress: Progress
    warn_s: float
    """controller.stall_warn_s"""
    fail_s: float
    """controller.stall_fail_s"""


@dataclass(frozen=True, slots=True)
class Ticking:
    """What the periodic work reads and changes: liveness and leases, the queue, eval rounds, the
    run's end, stalls, and the loop's state."""

    store: Store
    ledger: Ledger
    members: MemberTable
    accounting: MemberAccounting
    versions: PolicyVersions
    run: RunEnd
    control: RunControl
    queue: TaskQueue
    evals: Evaluator | None
    sinks: Sinks
    progress: Progress
    stalls: Stalls
    loop: LoopState
    member_timeout_s: float
    """controller.member_timeout_s: silent this long, a member is dead."""
    heartbeat_interval_s: float
    forget_after_s: float
    """controller.forget_after_s: dead this long, a member's row is deleted."""
    pace: BeatPace
    """The idle interval members are told: an idle member hears of the run's end at its next beat."""


def start(ctx: Starting) -> None:
    """Record the run (or read it back on restart) and give surviving members a fresh timer."""
    from astraflow.config.recipe_change import check_recipe_change
    from astraflow.rundir import git_sha

    keep = ctx.recipe.controller.retention
    if keep.keep_steps is not None and keep.action == "archive":
        from astraflow.state.archive import require_pyarrow

        require_pyarrow()  # a missing pyarrow is the user's to fix before the run, not at its first pass
    mine = ctx.recipe.model_dump(mode="json")
    run = ctx.store.run()
    if run is not None:
        # refused (RecipeError with the diff) unless allowed; an allowed change becomes the stored recipe
        if check_recipe_change(run["recipe"], mine, allow=ctx.allow_recipe_change):
            with ctx.store.write():
                ctx.store.replace_recipe(mine)
                ctx.store.add_event("recipe_changed", "restarted with --allow-recipe-change")
    fresh = ctx.store.init_run(ctx.recipe.run.name, mine, git_sha())
    with ctx.store.write():
        for p in ctx.recipe.policy:
            ctx.store.ensure_policy(p.name, p.max_staleness)
        # After a restart, members get one timeout to show up again before their leases go back.
        now = time.time()
        members.touch_alive(ctx.store, now)
        ctx.members.load(now, _restart_scale(ctx.recipe, members.alive_count(ctx.store)))
        ctx.store.add_event("start" if fresh else "restart", ctx.recipe.run.name)
        repaired = drop_poisoned(ctx.store)
        if repaired:
            _log.warning("state.db held values stored as NULL: %s", repaired)
        if ctx.evals is not None:
            ctx.evals.on_start()
    if not fresh:
        _log.info(
            "resumed run %s: %s",
            ctx.recipe.run.name,
            {p["name"]: p["step"] for p in ctx.store.policies()},
        )
        rewrite_lost_rows(ctx.store, ctx.run_dir / "metrics.jsonl", ctx.sinks, ctx.run)
    ctx.queue.refill()


def _restart_scale(recipe: Recipe, alive: int) -> float:
    """The timeout scale of every member a restarted controller finds alive, until its next beat says
    how often it beats: that of the longest idle interval the previous controller can have told."""
    cc = recipe.controller
    told = idle_interval(alive, cc.heartbeat_interval_s, cc.idle_beats_per_s)
    if told <= cc.heartbeat_interval_s:
        return 1.0
    return timeout_scale(told * (1.0 + CHANGE), cc.heartbeat_interval_s)


def tick(ctx: Ticking, now: float | None = None) -> list[str]:
    """Liveness, lease expiry, queue refill, end-of-run bookkeeping; returns the members it declared
    dead (their held requests are void)."""
    t = time.time() if now is None else now
    dead, expired = _expire(ctx, t)
    if expired:
        ctx.run.check_failed_streak("lease expired (no progress reported within rollout.lease_timeout_s)")
    ctx.queue.refill()
    if ctx.evals is not None and ctx.evals.pending():
        with ctx.store.write():
            rows = ctx.evals.finish_rounds()
        for row in rows:
            emit(ctx.sinks, ctx.run, row)
            made_progress(ctx.store, ctx.progress, t)
    budgets_met = ctx.versions.budgets_met() and not ctx.run.evals_pending()
    if ctx.run.finished_at is None and (budgets_met or ctx.control.stopped):
        ctx.run.finished_at = t
        _log.info("%s; telling members to stop", ctx.control.end_reason(ctx.versions.budgets_met()))
    if ctx.run.finished_at is None and not ctx.control.paused:
        check_stall(ctx.stalls, ctx.loop, t)  # a paused run waits on purpose
    ctx.sinks.retry()
    _settle_again(ctx.loop, len(ctx.members.seen))
    return dead


RESETTLE_MIN = 1000
"""Fewest members alive at which the heap is settled again (below, a full collection is cheap)."""


def _settle_again(loop: LoopState, alive: int) -> None:
    """Settle the heap again once the members alive doubled since it was last settled (and are at least
    RESETTLE_MIN): what the controller keeps per member (its rows, beats, timers: tens of thousands of
    objects at 10,000 members) otherwise stays in every full collection's walk, 50 ms each at 10,000
    members (docs/benchmarks.md). At most about log2(members) times in a run."""
    if loop.settled_members and alive >= RESETTLE_MIN and alive >= 2 * loop.settled_members:
        loop.settled_members = alive
        settle_heap()


def _expire(ctx: Ticking, t: float) -> tuple[list[str], int]:
    """Members silent past their timeout (member_timeout_s, scaled for one that said it beats less
    often: member_table.py) are dead (their leases go back), lapsed and expired leases
    return to the queue, long-dead members are pruned; the members declared dead and how many leases
    expired."""
    # the front of the heard-from order, not every member; nobody while beats wait unread
    silent = [] if ctx.loop.backlogged else ctx.members.silent(t, ctx.member_timeout_s)
    if silent:
        ctx.members.flush()  # what the dead last reported stays readable
    ctx.members.flush(t)
    dead: list[str] = []
    with ctx.store.write():
        for mid, last_seen in silent:
            timeout = ctx.members.timeout(mid, ctx.member_timeout_s)
            ctx.members.gone(mid)
            row = ctx.store.member(mid)
            if row is None or row["status"] != "alive":
                continue
            ctx.store.set_member_status(mid, "dead")
            dead.append(mid)
            n = ctx.ledger.release_member(mid)
            ctx.store.add_event("member_dead", f"{mid} silent {t - last_seen:.1f}s; {n} leases back")
            _log.warning("member %s is dead (silent > %.1fs); %d tasks requeued", mid, timeout, n)
        for owner in ctx.accounting.lapsed(t):
            ctx.ledger.give_back_lapsed(owner, t)  # its lapses are its own, not its tasks'
        expired = ctx.ledger.expire(t)
        if expired:
            failures.record(ctx.store, "lease expired", expired)
        if t - ctx.loop.last_prune >= PRUNE_EVERY_S:
            ctx.loop.last_prune = t
            for mid in authz.prune_members(ctx.store, t, ctx.forget_after_s):
                ctx.accounting.forget(mid)  # its failure history goes with its row
    return dead, expired


def check_stall(ctx: Stalls, loop: LoopState, now: float) -> None:
    """Warn (log, event, status) when nothing progressed for stall_warn_s; fail after stall_fail_s."""
    idle = now - ctx.progress.last
    if idle < ctx.warn_s:
        return
    if ctx.progress.warned_at is None or now - ctx.progress.warned_at >= ctx.warn_s:
        ctx.progress.warned_at = now
        report = stall_report(ctx, idle)
        with ctx.store.write():
            ctx.store.add_event("stall", json.dumps(report, sort_keys=True))
        _log.warning(
            "no progress for %.0fs: %s", idle, "; ".join(f"{k}: {v}" for k, v in report["waits"].items())
        )
    if idle >= ctx.fail_s and loop.exit_code == 0:
        _log.error("no progress for %.0fs (controller.stall_fail_s); stopping the run", idle)
        report = {**stall_report(ctx, idle), "failed": f"no progress for {idle:.0f}s"}
        with ctx.store.write():
            ctx.store.add_event("stall_fail", json.dumps(report, sort_keys=True))
        loop.exit_code = 1
        loop.stop_requested = True


def should_exit(ctx: Ticking, now: float) -> bool:
    """After the run's end: once every member left, or after a grace period."""
    if ctx.run.finished_at is None:
        return False
    if not ctx.store.members("alive"):
        return True
    grace = max(10.0, 4 * ctx.member_timeout_s, 2 * ctx.pace.told + 1.0)
    if ctx.run.failed is not None:
        # members learn of the end from their next heartbeat; nothing more is worth waiting for
        grace = 4 * ctx.heartbeat_interval_s + 1.0
    return now - ctx.run.finished_at > grace

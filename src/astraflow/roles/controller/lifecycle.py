"""The run's life: start (or resume) it, the periodic work between polls (liveness, lease expiry,
queue refill, eval rounds, the end of the run), stalls and when the loop may exit (a failure streak
ends the run through run_end.py)."""

from __future__ import annotations

import json
import time

from astraflow import log
from astraflow.dataflow import failures
from astraflow.dataflow.poisoned import drop_poisoned
from astraflow.dataflow.stall import stall_report
from astraflow.roles import authz
from astraflow.roles.controller.core import ControllerCore
from astraflow.roles.controller.metrics_row import emit, rewrite_lost_rows
from astraflow.state import members

_log = log.get("controller")

PRUNE_EVERY_S = 2.0
"""Seconds between passes that delete long-dead members."""


def start(ctl: ControllerCore) -> None:
    """Record the run (or read it back on restart) and give surviving members a fresh timer."""
    from astraflow.config.recipe_change import check_recipe_change
    from astraflow.rundir import git_sha

    keep = ctl.recipe.controller.retention
    if keep.keep_steps is not None and keep.action == "archive":
        from astraflow.state.archive import require_pyarrow

        require_pyarrow()  # a missing pyarrow is the user's to fix before the run, not at its first pass
    mine = ctl.recipe.model_dump(mode="json")
    run = ctl.store.run()
    if run is not None:
        # refused (RecipeError with the diff) unless allowed; an allowed change becomes the stored recipe
        if check_recipe_change(run["recipe"], mine, allow=ctl.allow_recipe_change):
            with ctl.store.write():
                ctl.store.replace_recipe(mine)
                ctl.store.add_event("recipe_changed", "restarted with --allow-recipe-change")
    fresh = ctl.store.init_run(ctl.recipe.run.name, mine, git_sha())
    with ctl.store.write():
        for p in ctl.recipe.policy:
            ctl.store.ensure_policy(p.name, p.max_staleness)
        # After a restart, members get one timeout to show up again before their leases go back.
        now = time.time()
        members.touch_alive(ctl.store, now)
        ctl.members.load(now)
        ctl.store.add_event("start" if fresh else "restart", ctl.recipe.run.name)
        repaired = drop_poisoned(ctl.store)
        if repaired:
            _log.warning("state.db held values stored as NULL: %s", repaired)
        if ctl.evals is not None:
            ctl.evals.on_start()
    if not fresh:
        _log.info(
            "resumed run %s: %s",
            ctl.recipe.run.name,
            {p["name"]: p["step"] for p in ctl.store.policies()},
        )
        rewrite_lost_rows(ctl.store, ctl.run_dir / "metrics.jsonl", ctl.sinks, ctl.run)
    ctl.refill()


def tick(ctl: ControllerCore, now: float | None = None) -> None:
    """Liveness, lease expiry, queue refill, end-of-run bookkeeping."""
    t = time.time() if now is None else now
    expired = _expire(ctl, t)
    if expired:
        ctl.run.check_failed_streak("lease expired (no progress reported within rollout.lease_timeout_s)")
    ctl.refill()
    if ctl.evals is not None and ctl.evals.pending():
        with ctl.store.write():
            rows = ctl.evals.finish_rounds()
        for row in rows:
            emit(ctl.sinks, ctl.run, row)
            ctl.made_progress(t)
    budgets_met = ctl.finished() and not ctl.evals_pending()
    if ctl.finished_at is None and (budgets_met or ctl.control.stopped):
        ctl.run.finished_at = t
        _log.info("%s; telling members to stop", ctl.control.end_reason(ctl.finished()))
    if ctl.finished_at is None and not ctl.control.paused:
        check_stall(ctl, t)  # a paused run waits on purpose
    ctl.sinks.retry()


def _expire(ctl: ControllerCore, t: float) -> int:
    """Members silent past member_timeout_s are dead (their leases go back), lapsed and expired leases
    return to the queue, long-dead members are pruned; how many leases expired."""
    timeout = ctl.recipe.controller.member_timeout_s
    silent = ctl.members.silent(t - timeout)  # the front of the heard-from order, not every member
    if silent:
        ctl.flush_touches()  # what the dead last reported stays readable
    ctl.members.flush(t)
    with ctl.store.write():
        for mid, last_seen in silent:
            ctl.members.gone(mid)
            row = ctl.store.member(mid)
            if row is None or row["status"] != "alive":
                continue
            ctl.store.set_member_status(mid, "dead")
            ctl.parked.drop(mid.encode())  # its held requests die with it
            n = ctl.ledger.release_member(mid)
            ctl.store.add_event("member_dead", f"{mid} silent {t - last_seen:.1f}s; {n} leases back")
            _log.warning("member %s is dead (silent > %.1fs); %d tasks requeued", mid, timeout, n)
        for owner in ctl.accounting.lapsed(t):
            ctl.ledger.give_back_lapsed(owner, t)  # its lapses are its own, not its tasks'
        expired = ctl.ledger.expire(t)
        if expired:
            failures.record(ctl.store, "lease expired", expired)
        if t - ctl.last_prune >= PRUNE_EVERY_S:
            ctl.last_prune = t
            authz.prune_members(ctl.store, t, ctl.recipe.controller.forget_after_s)
    return expired


def check_stall(ctl: ControllerCore, now: float) -> None:
    """Warn (log, event, status) when nothing progressed for stall_warn_s; fail after stall_fail_s."""
    cc = ctl.recipe.controller
    idle = now - ctl.progress.last
    if idle < cc.stall_warn_s:
        return
    if ctl.progress.warned_at is None or now - ctl.progress.warned_at >= cc.stall_warn_s:
        ctl.progress.warned_at = now
        report = stall_report(ctl, idle)
        with ctl.store.write():
            ctl.store.add_event("stall", json.dumps(report, sort_keys=True))
        _log.warning(
            "no progress for %.0fs: %s", idle, "; ".join(f"{k}: {v}" for k, v in report["waits"].items())
        )
    if idle >= cc.stall_fail_s and ctl.exit_code == 0:
        _log.error("no progress for %.0fs (controller.stall_fail_s); stopping the run", idle)
        report = {**stall_report(ctl, idle), "failed": f"no progress for {idle:.0f}s"}
        with ctl.store.write():
            ctl.store.add_event("stall_fail", json.dumps(report, sort_keys=True))
        ctl.exit_code = 1
        ctl.stop_requested = True


def should_exit(ctl: ControllerCore, now: float) -> bool:
    """After the run's end: once every member left, or after a grace period."""
    if ctl.finished_at is None:
        return False
    if not ctl.store.members("alive"):
        return True
    grace = max(10.0, 4 * ctl.recipe.controller.member_timeout_s)
    if ctl.failed is not None:
        # members learn of the end from their next heartbeat; nothing more is worth waiting for
        grace = 4 * ctl.recipe.controller.heartbeat_interval_s + 1.0
    return now - ctl.finished_at > grace

"""The controller service: one single-threaded loop that owns the run's state and answers every member.

It is the only writer of state.db. Each message is handled in its own transaction, and a reply is
sent only after that transaction committed, so whatever a member was told is on disk. Periodic
work (liveness, lease expiry, refilling the task queue) runs between polls.
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec

from astraflow import log
from astraflow.config.load import role_map
from astraflow.config.recipe import Recipe
from astraflow.dataflow import failures
from astraflow.dataflow.admission import admission_for
from astraflow.dataflow.batch_parts import part_bounds
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.control import RunControl
from astraflow.dataflow.evaluation import Evaluator, without_held_out
from astraflow.dataflow.ledger import Ledger, TaskRow
from astraflow.dataflow.limits import RefusedResult, seq_bytes
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.poisoned import drop_poisoned
from astraflow.dataflow.source import PromptSource, workflow_epochs
from astraflow.dataflow.stall import Progress, stall_report
from astraflow.dataflow.validate import ResultChecker
from astraflow.metrics.sinks import SinkFailed, Sinks
from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError
from astraflow.roles import authz
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.roles.member_table import MemberTable
from astraflow.roles.parked import Parked, ParkedRequests, immediate, may_park
from astraflow.roles.run_control import on_control
from astraflow.state.member_health import Kind
from astraflow.state.status import build_status
from astraflow.state.store import Store
from astraflow.transport.principal import Principal

_log = log.get("controller")

TICK_S = 0.1
"""Seconds between rounds of periodic work (and the poll timeout)."""
RETRY_S = 0.2
"""retry_after_s told to members when nothing is available yet."""
PRUNE_EVERY_S = 2.0
"""Seconds between passes that delete long-dead members."""


class Controller:
    """The controller's state and handlers; `serve` runs the loop until stopped or the run ends."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, store: Store, *, allow_recipe_change: bool = False
    ) -> None:
        self.recipe = recipe
        self.allow_recipe_change = allow_recipe_change
        self.run_dir = run_dir
        self.store = store
        rc = recipe.rollout
        self.ledger = Ledger(store, lease_timeout_s=rc.lease_timeout_s, max_attempts=rc.max_attempts)
        self.pipeline = Pipeline(recipe, store)
        self.buffer = Buffer(store, order=self.pipeline.order, replay_count=self.pipeline.replay_count)
        self.roles = role_map(recipe)
        self.task_policies = list(dict.fromkeys(self.roles.values()))
        self.group_sizes = {p: recipe.get_policy(p).group_size for p in self.task_policies}
        self.group_size = max(self.group_sizes.values())
        self.admission = admission_for(recipe, store, self.pipeline, self.roles)
        self.progress = Progress(time.time())
        self.evals = Evaluator(recipe, store, self.ledger, self.roles) if recipe.eval else None
        """Held-out evaluation rounds (dataflow/evaluation.py); None without an [eval] table."""
        epochs = workflow_epochs(recipe)
        if self.evals is not None:
            epochs = without_held_out(epochs, self.evals.identities())
        self.source = PromptSource(epochs, store)
        self.stop_requested = False
        self.exit_code = 0
        self.finished_at: float | None = None
        self.rate_hist: dict[str, deque[tuple[float, int]]] = {
            p.name: deque([(time.time(), 0)], maxlen=6) for p in recipe.policy
        }
        self.last_tick = 0.0
        self.last_prune = 0.0
        self.checker = ResultChecker(recipe)
        self.failed: str | None = None
        """Set (to the last error) once max_failed_tasks tasks in a row failed: the run ends with exit 1."""
        self.draining: set[str] = set()
        self.control = RunControl(store)
        """Paused admission and an operator's stop (`astraflow ctl`, the dashboard's keys)."""
        self._recipe_doc: dict[str, Any] | None = None
        """Members asked to leave (`astraflow leave`): they get no new tasks."""
        self.sinks = Sinks.from_specs(
            [(s.name, s.options) for s in recipe.metrics.sinks], run_dir, report=self.sink_event
        )
        self.parked = ParkedRequests()
        """Long polls (roles/parked.py): requests answered when an event may change their answer."""
        self._versions: list[m.VersionInfo] | None = None
        self._finished: bool | None = None
        """Read-through caches of the policies' versions and budgets: both change only when a version is
        recorded (on_version), and heartbeats of thousands of members read them."""
        self.members = MemberTable(store)
        """Live members' last_seen, loaded versions and slots in memory, flushed every FLUSH_S
        (roles/member_table.py): a heartbeat costs no write, the liveness check no scan."""
        self.offers: dict[str, tuple[int, list[m.WeightOffer]]] = {}
        """Policy -> (version, the faster weight paths its trainer offered for it); in memory only: after a
        restart workers pull the current version from the weight server until the next one."""
        self._handlers = cast(
            "dict[type, Callable[[dict[str, Any], Any], m.Msg]]",
            {
                m.Heartbeat: self.on_heartbeat,
                m.Bye: self.on_bye,
                m.TaskRequest: self.on_task_request,
                m.TaskResult: self.on_task_result,
                m.TaskResults: self.on_task_results,
                m.BatchRequest: self.on_batch_request,
                m.VersionPublished: self.on_version,
            },
        )
        """The member messages' handlers, each taking the message type it is keyed by (built once: a
        heartbeat flood must not rebuild it per message)."""
        self.accounting = MemberAccounting(store, recipe)
        """Per-member failures, quarantine, lease share and heartbeat rate (roles/member_accounting.py)."""

    # ----- start and stop -----------------------------------------------------------------------

    def start(self) -> None:
        """Record the run (or read it back on restart) and give surviving members a fresh timer."""
        from astraflow.config.recipe_change import check_recipe_change
        from astraflow.rundir import git_sha

        keep = self.recipe.controller.retention
        if keep.keep_steps is not None and keep.action == "archive":
            from astraflow.state.archive import require_pyarrow

            require_pyarrow()  # a missing pyarrow is the user's to fix before the run, not at its first pass
        mine = self.recipe.model_dump(mode="json")
        run = self.store.run()
        if run is not None:
            # refused (RecipeError with the diff) unless allowed; an allowed change becomes the stored recipe
            if check_recipe_change(run["recipe"], mine, allow=self.allow_recipe_change):
                with self.store.write() as c:
                    c.execute("UPDATE runs SET recipe = ?", (json.dumps(mine, sort_keys=True),))
                    self.store.add_event("recipe_changed", "restarted with --allow-recipe-change")
        fresh = self.store.init_run(self.recipe.run.name, mine, git_sha())
        with self.store.write() as c:
            for p in self.recipe.policy:
                self.store.ensure_policy(p.name, p.max_staleness)
            # After a restart, members get one timeout to show up again before their leases go back.
            now = time.time()
            c.execute("UPDATE members SET last_seen = ? WHERE status = 'alive'", (now,))
            self.members.load(now)
            self.store.add_event("start" if fresh else "restart", self.recipe.run.name)
            repaired = drop_poisoned(self.store)
            if repaired:
                _log.warning("state.db held values stored as NULL: %s", repaired)
            if self.evals is not None:
                self.evals.on_start()
        if not fresh:
            _log.info(
                "resumed run %s: %s",
                self.recipe.run.name,
                {p["name"]: p["step"] for p in self.store.policies()},
            )
            self.rewrite_lost_rows()
        self.refill()

    def finished(self) -> bool:
        """True once every trainable policy reached its step budget."""
        if self._finished is None:
            steps = {p["name"]: int(p["step"]) for p in self.store.policies()}
            self._finished = all(
                steps.get(p.name, 0) >= self.recipe.budget(p.name) for p in self.recipe.trainable()
            )
        return self._finished

    def versions(self) -> list[m.VersionInfo]:
        """The newest version of each policy that has one."""
        if self._versions is None:
            self._versions = [
                m.VersionInfo(
                    policy=v["policy"],
                    version=v["version"],
                    weights_addr=v["weights_addr"] or "",
                    sha256=v["sha256"] or "",
                    offers=self._offers_for(v["policy"], v["version"]),
                )
                for v in self.store.latest_versions()
            ]
        return list(self._versions)

    def _versions_changed(self) -> None:
        """Forget the cached versions and budgets (a version was recorded)."""
        self._versions = None
        self._finished = None

    def flush_touches(self) -> None:
        """Write the heartbeats seen since the last flush (last_seen, loaded version, slots) at once."""
        self.members.flush()

    def versions_for(self, member: dict[str, Any], beat: m.Heartbeat | None = None) -> list[m.VersionInfo]:
        """The newest versions as `member` should pull them: with `[weights] relays`, each names the
        relays of the member's region that hold it (a heartbeat first updates the directory)."""
        infos = self.versions()
        if not self.recipe.weights.relays:
            return infos
        from astraflow.weights.relay import RelayDirectory

        now = time.time()
        if not hasattr(self, "relay_dir"):
            self.relay_dir = RelayDirectory(self.recipe.controller.member_timeout_s)
        mid, region = str(member["id"]), str(member.get("region") or "")
        if beat is not None:
            self.relay_dir.update(mid, region, beat.relay_addr, dict(beat.loaded), now)
        # the cached infos are shared by every member: each gets copies naming its own region's relays
        return [
            msgspec.structs.replace(
                info, relays=self.relay_dir.relays_for(mid, region, info.policy, info.version, now)
            )
            if info.weights_addr
            else info
            for info in infos
        ]

    def _offers_for(self, policy: str, version: int) -> list[m.WeightOffer]:
        held = self.offers.get(policy)
        return held[1] if held is not None and held[0] == version else []

    # ----- periodic work ------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Liveness, lease expiry, queue refill, end-of-run bookkeeping."""
        t = time.time() if now is None else now
        timeout = self.recipe.controller.member_timeout_s
        silent = self.members.silent(t - timeout)  # the front of the heard-from order, not every member
        if silent:
            self.flush_touches()  # what the dead last reported stays readable
        self.members.flush(t)
        with self.store.write():
            for mid, last_seen in silent:
                self.members.gone(mid)
                row = self.store.member(mid)
                if row is None or row["status"] != "alive":
                    continue
                self.store.set_member_status(mid, "dead")
                self.parked.drop(mid.encode())  # its held requests die with it
                n = self.ledger.release_member(mid)
                self.store.add_event("member_dead", f"{mid} silent {t - last_seen:.1f}s; {n} leases back")
                _log.warning("member %s is dead (silent > %.1fs); %d tasks requeued", mid, timeout, n)
            for owner in self.accounting.lapsed(t):
                self.ledger.give_back_lapsed(owner, t)  # its lapses are its own, not its tasks'
            expired = self.ledger.expire(t)
            if expired:
                failures.record(self.store, "lease expired", expired)
            if t - self.last_prune >= PRUNE_EVERY_S:
                self.last_prune = t
                authz.prune_members(self.store, t, self.recipe.controller.forget_after_s)
        if expired:
            self.check_failed_streak("lease expired (no progress reported within rollout.lease_timeout_s)")
        self.refill()
        if self.evals is not None and self.evals.pending():
            with self.store.write():
                rows = self.evals.finish_rounds()
            for row in rows:
                self.emit(row)
                self.made_progress(t)
        budgets_met = self.finished() and not self.evals_pending()
        if self.finished_at is None and (budgets_met or self.control.stopped):
            self.finished_at = t
            _log.info("%s; telling members to stop", self.control.end_reason(self.finished()))
        if self.finished_at is None and not self.control.paused:
            self.check_stall(t)  # a paused run waits on purpose
        self.sinks.retry()

    def check_stall(self, now: float) -> None:
        """Warn (log, event, status) when nothing progressed for stall_warn_s; fail after stall_fail_s."""
        cc = self.recipe.controller
        idle = now - self.progress.last
        if idle < cc.stall_warn_s:
            return
        if self.progress.warned_at is None or now - self.progress.warned_at >= cc.stall_warn_s:
            self.progress.warned_at = now
            report = stall_report(self, idle)
            with self.store.write():
                self.store.add_event("stall", json.dumps(report, sort_keys=True))
            _log.warning(
                "no progress for %.0fs: %s", idle, "; ".join(f"{k}: {v}" for k, v in report["waits"].items())
            )
        if idle >= cc.stall_fail_s and self.exit_code == 0:
            _log.error("no progress for %.0fs (controller.stall_fail_s); stopping the run", idle)
            report = {**stall_report(self, idle), "failed": f"no progress for {idle:.0f}s"}
            with self.store.write():
                self.store.add_event("stall_fail", json.dumps(report, sort_keys=True))
            self.exit_code = 1
            self.stop_requested = True

    def made_progress(self, now: float | None = None) -> None:
        """A result was accepted, a batch recorded or a version published: the run moves."""
        t = time.time() if now is None else now
        if self.progress.warned_at is not None:
            with self.store.write():
                self.store.add_event("unstalled", f"progress after {t - self.progress.last:.0f}s")
            self.progress.warned_at = None
        self.progress.last = t

    def refill(self, limit: int = 1024) -> int:
        """Queue prompts through admission and the curators; returns how many tasks were queued."""
        if self.stopping():
            return 0
        plan = self.control.admit(self.admission.plan(self.roles, self.group_sizes))[:limit]
        if not plan:
            return 0
        queued, offered = 0, 0
        with self.store.write():
            while queued < len(plan) and offered < self.admission.offer_limit(len(plan)):
                key, sample = self.source.next()
                offered += 1
                feeds = plan[queued]
                if self.pipeline.submit(key, sample, feeds):
                    skip = [p for p in self.task_policies if p not in feeds]
                    self.ledger.enqueue(key, {"key": key, **sample}, self.roles, self.group_size, skip)
                    queued += 1
            self.source.save()
            if offered:
                # the curators' draws commit with the tasks they queued
                for pol in self.task_policies:
                    self.pipeline.save(pol)
        return queued

    # ----- handlers -----------------------------------------------------------------------------

    def handle(
        self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None = None
    ) -> m.Msg | None:
        """The reply to one message (None: no reply); `principal` is the sender's key (None: auth off)."""
        if isinstance(msg, DecodeError):
            return m.Error(rid=msg.rid, code=getattr(msg, "code", "bad_message"), message=str(msg)[:500])
        member_id = ident.decode("utf-8", "replace")
        rid = msg.rid
        if isinstance(msg, m.Hello):
            return self.on_hello(ident, msg, principal)
        if isinstance(msg, m.StatusRequest):
            self.flush_touches()
            room = self.admission.room(self.roles, self.group_sizes)
            return m.StatusReply(rid=rid, status=build_status(self.store, room))
        if isinstance(msg, m.Leave):
            return self.on_leave(msg, principal)
        if isinstance(msg, m.Control):
            return on_control(self, msg, principal)
        if not isinstance(msg, m.Heartbeat):
            # heartbeats (the flood of a large cluster) use the kept row; the rest read the store's
            self.members.forget(member_id)
        member = self.members.row(member_id)
        if member is None or member["status"] != "alive":
            return m.Error(
                rid=rid, code="unknown_member", message=f"{member_id!r} has not joined; send Hello"
            )
        refused = authz.message_refusal(member, msg, principal)
        if refused is not None:
            _log.warning("refused %s from %r: %s", type(msg).__name__, member_id[:64], refused[1])
            return m.Error(rid=rid, code=refused[0], message=refused[1])
        # each handler takes the message type it is keyed by
        handler = self._handlers.get(type(msg))
        if handler is None:
            return m.Error(
                rid=rid,
                code="unexpected_message",
                message=f"the controller does not take {type(msg).__name__}",
            )
        return handler(member, msg)

    def on_hello(self, ident: bytes, msg: m.Hello, principal: Principal | None = None) -> m.Msg:
        """Check protocol, identity and role, register the member, send the recipe and versions."""
        if msg.protocol != m.PROTOCOL_VERSION:
            return m.Error(
                rid=msg.rid,
                code="protocol_version",
                message=f"controller speaks protocol {m.PROTOCOL_VERSION}, member {msg.protocol}; install matching astraflow versions",
            )
        if msg.member_id.encode() != ident:
            return m.Error(
                rid=msg.rid, code="bad_identity", message="member_id must equal the socket identity"
            )
        msg = authz.cap_hello(msg)
        self.flush_touches()  # the identity checks read last_seen from the store
        refused = authz.hello_refusal(self.store, self.recipe, msg, principal)
        if refused is not None:
            _log.warning("refused Hello of %r as %s: %s", msg.member_id[:64], msg.role, refused[1])
            return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
        with self.store.write():
            prev = self.store.member(msg.member_id)
            released = 0
            if prev is not None and (prev.get("pid") != msg.pid or prev.get("host") != msg.host):
                # a new process under an id that fell silent holds none of the old one's tasks
                released = self.ledger.release_member(msg.member_id)
                # a drain was asked of the old process; the same process rejoining stays draining
                self.draining.discard(msg.member_id)
            self.store.upsert_member(
                msg.member_id,
                msg.role,
                policies=list(msg.policies),
                region=msg.region,
                hardware=msg.hardware,
                slots=msg.slots,
                pid=msg.pid,
                host=msg.host,
            )
            self.store.add_event(
                "member_joined" if prev is None else "member_rejoined",
                f"{msg.member_id} {msg.role}"
                + (f"; {released} leases of its previous process back" if released else ""),
            )
        self.members.joined(msg.member_id, time.time())
        _log.info("member %s joined as %s (%s)", msg.member_id, msg.role, msg.hardware or "?")
        if self._recipe_doc is None:
            self._recipe_doc = self.recipe.model_dump(mode="json")
        return m.Welcome(
            rid=msg.rid,
            run_name=self.recipe.run.name,
            recipe=self._recipe_doc,
            heartbeat_interval_s=self.recipe.controller.heartbeat_interval_s,
            versions=self.versions(),
        )

    def on_heartbeat(self, member: dict[str, Any], msg: m.Heartbeat) -> m.Msg:
        """Touch the member, renew its leases, tell it the versions and whether to stop."""
        now = time.time()
        if not self.accounting.heartbeat_allowed(member["id"], now):
            return m.Error(rid=msg.rid, code="rate_limited", message="heartbeats too fast: nothing recorded")
        new_error = bool(msg.error) and self.accounting.new_error(member["id"], msg.error)
        slots = msg.busy + msg.free
        # last_seen needs no durability (a restarted controller gives every member a fresh timer):
        # it is written with the other heartbeats of this tick, before the liveness check reads it
        self.members.touch(
            member["id"], now, dict(msg.loaded) if msg.loaded else None, slots if slots > 0 else None
        )
        if msg.active or new_error:
            with self.store.write():
                # only leases the worker reports working on are renewed, and none past the task timeout
                rc = self.recipe.rollout
                max_age = rc.lease_max_age_s or rc.task_timeout_s + rc.lease_timeout_s
                self.ledger.renew_tasks(member["id"], msg.active, now, max_age_s=max_age)
                if new_error:
                    self.store.add_event("member_error", f"{member['id']}: {msg.error[:500]}")
        if new_error:
            _log.warning("member %s reports: %s", member["id"], msg.error[:500])
        # Requests are handled in the order they arrive, so every request the member sent before this
        # heartbeat is answered (its reply is ahead of this one) or held; any other was never received.
        ident = str(member["id"]).encode()
        lost = [rid for rid in msg.waiting if not self.parked.holds(ident, rid)]
        versions = self.versions_for(member, msg)
        return m.HeartbeatAck(rid=msg.rid, versions=versions, stop=self.stopping(), lost=lost)

    def on_bye(self, member: dict[str, Any], msg: m.Bye) -> m.Msg:
        """Return the member's leases at once and mark it left."""
        with self.store.write():
            n = self.ledger.release_member(member["id"])
            self.store.set_member_status(member["id"], "left")
            self.members.gone(member["id"])
            self.store.add_event("member_left", f"{member['id']} ({msg.reason[:500]}); {n} leases back")
        self.parked.drop(str(member["id"]).encode())
        self.draining.discard(member["id"])
        _log.info("member %s left (%s); %d tasks requeued", member["id"], msg.reason[:200] or "-", n)
        return m.Ack(rid=msg.rid)

    def on_leave(self, msg: m.Leave, principal: Principal | None) -> m.Msg:
        """Drain a member (`astraflow leave`): no new tasks; it finishes or returns its leases and says Bye."""
        refused = authz.leave_refusal(msg, principal)
        if refused is not None:
            return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
        member = self.store.member(msg.member_id)
        if member is None or member["status"] != "alive":
            return m.Error(rid=msg.rid, code="unknown_member", message=f"no live member {msg.member_id!r}")
        self.draining.add(member["id"])
        self.store.add_event("member_draining", member["id"])
        _log.info("member %s asked to leave; draining it", member["id"])
        return m.Ack(rid=msg.rid, detail="draining")

    def on_task_request(self, member: dict[str, Any], msg: m.TaskRequest) -> m.Msg:
        """Lease up to n admitted tasks the member can serve (credit-based flow control)."""
        if self.stopping():
            return m.TaskGrant(rid=msg.rid, stop=True, versions=self.versions())
        if member["id"] in self.draining:
            return m.Error(
                rid=msg.rid, code="draining", message="asked to leave: finish your tasks and say Bye"
            )
        if not self.accounting.may_lease(member):
            self.members.touch(member["id"], time.time(), dict(msg.loaded) or None)
            return m.TaskGrant(rid=msg.rid, versions=self.versions(), retry_after_s=RETRY_S)
        now = time.time()
        serves = set(member["policies"])
        loaded = dict(msg.loaded)

        refused: set[tuple[Any, ...]] = set()

        def accept(task: TaskRow) -> bool:
            ok = admit(task)
            if ok:  # the ledger leases every task accepted: it is in flight for the next ones
                self.admission.leased(task.roles, task.group_size, task.read_only)
            return ok

        def admit(task: TaskRow) -> bool:
            pols = task.policies
            if self.evals is not None and self.evals.is_eval(task.id):
                return (not serves or serves.issuperset(pols)) and self.evals.may_lease(task, loaded)
            feeds = [p for p in pols if p not in task.read_only]
            per = self.admission.task_sequences(task.roles, self.group_sizes)
            # Within one lease call every lease only adds work ahead, so a task shape refused once
            # stays refused: later queued tasks of that shape are skipped without asking the store.
            key = (tuple(pols), tuple(feeds), tuple(sorted(per.items())))
            if key in refused:
                return False
            # a task that feeds no policy still training would be run only to be thrown away
            ok = (
                (not serves or serves.issuperset(pols))
                and self.control.may_lease(feeds)
                and bool(self.admission.active(feeds))
                and self.admission.may_lease(loaded, feeds, per)
            )
            if not ok:
                refused.add(key)
            return ok

        self.refill()
        self.members.touch(member["id"], now, loaded or None)
        with self.store.write():
            n = self.accounting.quota(member, authz.task_quota(self.store, self.recipe, member, msg.n))
            with self.admission.leasing():
                leased = self.ledger.lease(member["id"], n, now, accept)
            for t in leased:
                # what the worker is told not to keep is what its result is stored by (see on_task_result)
                read_only = set(t.read_only) | set(self.admission.read_only(t.policies))
                if read_only != set(t.read_only):
                    self.ledger.set_read_only(t, read_only)
        tasks = [
            m.Task(
                task_id=t.id,
                epoch=t.epoch,
                sample=t.sample,
                group_size=t.group_size,
                roles=t.roles,
                group_sizes=self._task_sizes(t),
                read_only=t.read_only,
                sampling=self._task_sampling(t),
            )
            for t in leased
        ]
        return m.TaskGrant(
            rid=msg.rid,
            tasks=tasks,
            versions=self.versions_for(member),
            retry_after_s=0.0 if tasks else RETRY_S,
        )

    def on_task_result(self, member: dict[str, Any], msg: m.TaskResult) -> m.Msg:
        """Validate the lease; store trajectories, advantages and filter outcomes durably; then ack."""
        if msg.error:
            status = self.member_failed(member, msg.task_id, msg.epoch, msg.error[:8000], "failures")
            return m.ResultAck(
                rid=msg.rid,
                task_id=msg.task_id,
                status="failed" if status in ("requeued", "failed") else status,
            )
        task = self.ledger.get(msg.task_id)
        bad = self._invalid(member, msg, task, None)
        if bad is not None:
            return m.Error(rid=msg.rid, code="bad_result", message=bad)
        try:
            with self.store.write():
                status = self._store_result(member, msg, task)
                if status == "accepted" and task is not None:
                    # stage state commits with the result that changed it: a kill -9 loses neither
                    for pol in task.policies:
                        self.pipeline.save(pol)
        except RefusedResult as exc:
            # rolled back: nothing of the result is kept (advantages that do not fit a float)
            status = self.fail_attempt(member["id"], msg.task_id, msg.epoch, f"invalid result: {exc}")
            return m.Error(rid=msg.rid, code="bad_result", message=f"task {msg.task_id}: {exc} ({status})")
        return m.ResultAck(rid=msg.rid, task_id=msg.task_id, status=status)

    def on_task_results(self, member: dict[str, Any], msg: m.TaskResults) -> m.Msg:
        """Group commit: check every result, store the valid ones in one transaction (stage state saved
        once per policy), then ack each. A result refused while stored rolls the group back, and each
        result is then handled alone, as a TaskResult would be."""
        acks: dict[int, m.OutcomeAck] = {}
        good: list[tuple[int, m.Outcome, TaskRow | None]] = []
        tasks = self.ledger.get_many(o.task_id for o in msg.results if not o.error)
        latest: dict[str, int] = {}
        for i, o in enumerate(msg.results):
            if o.error:
                acks[i] = _outcome_ack(o.task_id, self.on_task_result(member, _single(o)))
                continue
            task = tasks.get(o.task_id)
            bad = self._invalid(member, o, task, latest)
            if bad is not None:
                acks[i] = m.OutcomeAck(task_id=o.task_id, status="invalid", code="bad_result", message=bad)
            else:
                good.append((i, o, task))
        try:
            with self.store.write():
                fed: dict[str, None] = {}
                for i, o, task in good:
                    acks[i] = m.OutcomeAck(task_id=o.task_id, status=self._store_result(member, o, task))
                    if acks[i].status == "accepted" and task is not None:
                        fed.update(dict.fromkeys(task.policies))
                for pol in fed:
                    self.pipeline.save(pol)
        except RefusedResult:
            for i, o, _task in good:
                acks[i] = _outcome_ack(o.task_id, self.on_task_result(member, _single(o)))
        return m.ResultsAck(rid=msg.rid, acks=[acks[i] for i in range(len(msg.results))])

    def _invalid(
        self,
        member: dict[str, Any],
        res: m.TaskResult | m.Outcome,
        task: TaskRow | None,
        latest: dict[str, int] | None,
    ) -> str | None:
        """Why a result of a live lease of this member is refused (the attempt is charged), or None.
        `latest` caches the policies' versions over the results of one message."""
        # a lapsed lease still accepts its owner's late result, so that one is checked too
        if task is None or task.status not in ("leased", "queued") or task.owner != member["id"]:
            return None
        if not latest:
            latest = {} if latest is None else latest
            latest.update({p["name"]: int(p["version"]) for p in self.store.policies()})
        sizes = self._task_sizes(task)
        bad = self.checker.check(
            res.episodes,
            expected=self.admission.task_sequences(task.roles, sizes),
            roles=task.roles,
            latest=latest,
            task_sampling=self._task_sampling(task),
        )
        if not bad:
            return None
        status = self.member_failed(member, res.task_id, res.epoch, f"invalid result: {bad}", "invalid")
        return f"task {res.task_id}: {bad} ({status})"

    def _store_result(
        self, member: dict[str, Any], res: m.TaskResult | m.Outcome, task: TaskRow | None
    ) -> str:
        """Complete the task's lease and store what the result brings (inside the caller's transaction,
        which also saves the stage state of the task's policies); the status."""
        with self.store.write():
            status = self.ledger.complete(res.task_id, res.epoch, member["id"])
            if status == "accepted":
                self.accounting.succeeded(member["id"])
            if status == "accepted" and self._is_eval(res.task_id):
                assert self.evals is not None
                self.evals.record(res.task_id, res.episodes)
                self.made_progress()
            elif status == "accepted":
                assert task is not None
                self.pipeline.ingest(
                    self.buffer,
                    task.id,
                    task.prompt_key,
                    res.episodes,
                    # decided when the task was leased: a done task keeps a full group of every policy
                    # it fed, even when that policy's budget was taken while the task ran
                    read_only=task.read_only,
                )
                self.made_progress()
        return status

    def _is_eval(self, task_id: int) -> bool:
        return self.evals is not None and self.evals.is_eval(task_id)

    def _task_sizes(self, task: TaskRow) -> dict[str, int]:
        """Policy -> group size of a task: the recipe's, or eval.samples for an eval task."""
        if self.evals is not None and self.evals.is_eval(task.id):
            return self.evals.group_sizes(task)
        return {p: self.group_sizes.get(p, task.group_size) for p in task.policies}

    def _task_sampling(self, task: TaskRow) -> dict[str, float | int]:
        """Sampling overrides of a task: eval.sampling for an eval task, none otherwise."""
        if self.evals is not None and self.evals.is_eval(task.id):
            return self.evals.cfg.sampling.overrides()
        return {}

    def member_failed(self, member: dict[str, Any], task_id: int, epoch: int, error: str, kind: Kind) -> str:
        """A member's attempt failed: charge the member; the task too unless a healthy peer does far better."""
        task = self.ledger.get(task_id)
        if task is None or task.status != "leased" or task.epoch != epoch or task.owner != member["id"]:
            return self.fail_attempt(member["id"], task_id, epoch, error)  # not a live attempt of its own
        if self.accounting.failed(member, kind) or not self.ledger.give_back(task_id, epoch, member["id"]):
            return self.fail_attempt(member["id"], task_id, epoch, error)
        return "requeued"

    def fail_attempt(self, member_id: str, task_id: int, epoch: int, error: str) -> str:
        """End a leased attempt with an error: count it by reason and end the run after too many failed tasks."""
        with self.store.write():
            status = self.ledger.fail(task_id, epoch, member_id, error)
            if status in ("requeued", "failed"):
                reason = failures.record(self.store, error)
                self.store.add_event(
                    "task_failed", f"task {task_id} on {member_id}: {reason}: {_summary(error)}"
                )
        if status in ("requeued", "failed"):
            _log.warning("task %d failed on %s (%s):\n%s", task_id, member_id, status, error[:8000])
            if status == "failed":
                self.check_failed_streak(error)
        return status

    def check_failed_streak(self, error: str) -> None:
        """End the run (exit 1) once max_failed_tasks tasks in a row failed every attempt."""
        n = self.recipe.rollout.max_failed_tasks
        if self.failed is None and failures.failed_streak(self.store, n):
            self.failed = failures.tail(error, 2000)
            self.finished_at = time.time()
            self.store.add_event("run_failed", f"{n} tasks in a row failed; last error: {_summary(error)}")
            _log.error(
                "%d tasks in a row failed every attempt (rollout.max_failed_tasks); ending the run. Last error:\n%s",
                n,
                failures.tail(error, 2000),
            )

    def stopping(self) -> bool:
        """True once members should stop: every budget (and the last eval round) met, a stop, or a failure."""
        return (
            self.failed is not None or self.control.stopped or (self.finished() and not self.evals_pending())
        )

    def evals_pending(self) -> bool:
        """True while a held-out eval round is not yet aggregated."""
        return self.evals is not None and self.evals.pending()

    def on_batch_request(self, member: dict[str, Any], msg: m.BatchRequest) -> m.Msg:
        """The recorded batch of the step, a new one, not ready yet, or done."""
        try:
            pol = self.recipe.get_policy(msg.policy)
        except KeyError:
            return m.Error(
                rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run"
            )
        if msg.step < 1:
            return m.Error(rid=msg.rid, code="bad_request", message="steps are numbered from 1")
        if self.failed is not None:
            return m.Error(rid=msg.rid, code="run_failed", message=f"the run failed: {_summary(self.failed)}")
        if msg.step > self.recipe.budget(msg.policy) or self.control.stopped:
            # an operator's stop ends the trainer after the step it holds (it checkpoints, exits 0)
            if not self.control.stopped and self.evals_pending():
                # the trainer's weight server must outlive the last eval round, which may still pull it
                return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
            return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, done=True)
        refused = authz.batch_refusal(self.store, msg.policy, msg.step)
        if refused is not None:
            return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
        if msg.part > 0:
            return self._batch_part(msg)
        # a trainer one step ahead holds version step-1 (still being announced): staleness counts from it
        version = max(int(self.store.policy(msg.policy)["version"]), msg.step - 1)
        with self.store.write():
            # the batch, its trajectories' status and the composers' counters commit together
            batch = self.buffer.next_batch(
                msg.policy, msg.step, pol.batch_prompts * pol.group_size, pol.max_staleness, version
            )
            if batch is not None and batch.new:
                self.pipeline.on_batch(msg.policy, sum(1 for s in batch.samples if s.replay))
                self.pipeline.save(msg.policy)
        if batch is None:
            self.refill()
            return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
        if batch.new:
            self.made_progress()
        bounds = self._part_bounds([s.traj_id for s in batch.samples], [len(s.tokens) for s in batch.samples])
        served = self.pipeline.batch_samples(msg.policy, batch.samples)  # the estimator's batch stage
        return m.BatchReply(
            rid=msg.rid,
            policy=msg.policy,
            step=msg.step,
            samples=served[: bounds[0][1]],
            ready=True,
            parts=len(bounds),
        )

    def _part_bounds(self, ids: list[int], lengths: list[int] | None = None) -> list[tuple[int, int]]:
        """Where a recorded batch of these trajectories splits into parts (dataflow/batch_parts.py);
        `lengths` (tokens per sample, when at hand) skip the size query for a batch that surely fits."""
        budget = self.recipe.controller.batch_part_bytes
        if lengths is not None and sum(seq_bytes(n) for n in lengths) <= budget:
            return [(0, len(ids))]  # the exact sizes are smaller still: the same answer
        return part_bounds(self.buffer.sample_bytes(ids), budget)

    def _batch_part(self, msg: m.BatchRequest) -> m.Msg:
        """Part `msg.part` (> 0) of a recorded batch."""
        rec = self.buffer.recorded_ids(msg.policy, msg.step)
        bounds = self._part_bounds(rec[0]) if rec is not None else []
        if rec is None or msg.part >= len(bounds):
            return m.Error(
                rid=msg.rid,
                code="bad_request",
                message=f"step {msg.step} of {msg.policy!r} has no recorded part {msg.part} ({len(bounds)} parts)",
            )
        a, b = bounds[msg.part]
        samples = self.buffer.samples(rec[0][a:b], rec[1][a:b])
        if self.pipeline.batch_level(msg.policy):  # normalised over the whole batch, not this part
            samples = self.pipeline.batch_samples(msg.policy, samples, self.buffer.advantages(rec[0]), a)
        return m.BatchReply(
            rid=msg.rid,
            policy=msg.policy,
            step=msg.step,
            samples=samples,
            ready=True,
            part=msg.part,
            parts=len(bounds),
        )

    def on_version(self, member: dict[str, Any], msg: m.VersionPublished) -> m.Msg:
        """Record the version and step, write the step's metrics, tell the curators; then ack."""
        if msg.policy not in self.pipeline.policies:
            return m.Error(
                rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run"
            )
        refused = authz.version_refusal(self.store, msg)
        if refused is not None:
            _log.warning(
                "refused version %d of %s from %s: %s", msg.version, msg.policy, member["id"], refused[1]
            )
            return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
        now = time.time()
        if msg.offers and msg.version >= self.offers.get(msg.policy, (-1, []))[0]:
            self.offers[msg.policy] = (msg.version, list(msg.offers))
        with self.store.write():
            new = self.store.record_version(
                msg.policy, msg.version, msg.step, msg.weights_addr, msg.sha256, msg.nbytes
            )
            self._versions_changed()
            row: dict[str, Any] | None = None
            if new:
                row = self.step_metrics(msg, now)
                self.store.add_metrics(
                    msg.policy, msg.step, {k: v for k, v in row.items() if isinstance(v, int | float)}, now
                )
                self.pipeline.on_version(msg.policy, msg.version)
                self._note_skipped(msg)
                if self.evals is not None:
                    self.evals.on_version(msg.policy, msg.version, msg.step)
                self.made_progress(now)
        if row is not None:
            self.emit(row)
            self.retire(msg.policy, msg.step)
        return m.Ack(rid=msg.rid, detail="recorded" if new else "known")

    def retire(self, policy: str, step: int) -> None:
        """A retention pass (controller.retention) every `every_steps` steps of a policy: trajectories
        trained on long ago leave state.db for the archive (state/archive.py), or are dropped; then the
        done tasks older than every trajectory left leave too (state/tasks.py, counted per owner)."""
        keep = self.recipe.controller.retention
        if keep.keep_steps is None or step % keep.every_steps:
            return
        from astraflow.state import archive, tasks

        n = archive.retire(self.store, self.run_dir, policy, step, keep.keep_steps, keep.action)
        if n:
            _log.info("retention: %d trajectories of %s left state.db (%s)", n, policy, keep.action)
            done = tasks.retire_done(self.store)
            if done:
                _log.info("retention: %d done tasks left state.db", done)

    def _note_skipped(self, msg: m.VersionPublished) -> None:
        """A step the trainer skipped (non-finite loss or gradient norm) becomes a `step_skipped` event."""
        if not msg.metrics.get("trainer_skipped_step"):
            return
        in_a_row = int(msg.metrics.get("trainer_skipped_in_a_row", 1))
        detail = {"policy": msg.policy, "step": msg.step, "in_a_row": in_a_row}
        self.store.add_event("step_skipped", json.dumps(detail, sort_keys=True))
        _log.warning(
            "policy %s step %d was skipped by its trainer: non-finite loss or gradient norm (%d in a row)",
            msg.policy,
            msg.step,
            in_a_row,
        )

    def step_metrics(self, msg: m.VersionPublished, now: float) -> dict[str, Any]:
        """The metrics row of a finished step: batch reward and staleness, pipeline counters, trainer metrics."""
        rec = self.buffer.recorded_ids(msg.policy, msg.step)
        ref = rec[2] if rec else msg.version - 1
        fresh_ids = [i for i, replay in zip(rec[0], rec[1], strict=True) if not replay] if rec else []
        rewards: list[float] = []
        stale: list[int] = []
        task_ids: list[int] = []
        if fresh_ids:
            marks = ",".join("?" for _ in fresh_ids)
            for r in self.store.query(
                f"SELECT reward, min_version, task_id FROM trajectories WHERE id IN ({marks})",
                tuple(fresh_ids),
            ):
                rewards.append(float(r["reward"]))
                stale.append(ref - int(r["min_version"]))
                task_ids.append(int(r["task_id"]))
        counts = self.buffer.open_counts(msg.policy)
        if self.recipe.controller.retention.keep_steps is not None:
            from astraflow.state.archive import archived_counts

            for k, v in archived_counts(self.store, msg.policy).items():
                if k in counts:
                    counts[k] += v
        tasks = self.ledger.counts()
        generated = self.buffer.generated(msg.policy)
        hist = self.rate_hist.setdefault(msg.policy, deque(maxlen=6))
        hist.append((now, generated))
        t0, g0 = hist[0]
        rate = (generated - g0) / (now - t0) if now > t0 else 0.0
        row: dict[str, Any] = dict(self.pipeline.metrics(msg.policy))
        row.update(self.pipeline.take_info(msg.policy, task_ids))
        row.update(self.buffer.role_metrics(fresh_ids))
        row.update(
            {
                "policy": msg.policy,
                "step": msg.step,
                "version": msg.version,
                "time": now,
                "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
                "samples_per_s": rate,
                "samples_generated": generated,
                "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
                "staleness_max": float(max(stale)) if stale else 0.0,
                "expired": counts["expired"],
                "dropped": counts["dropped"],
                "buffered": counts["buffered"],
                **{f"tasks_{k}": v for k, v in tasks.items()},
            }
        )
        # a peer's NaN would be stored as NULL or as text no JSON reader takes
        return with_trainer_metrics(row, {k: float(v) for k, v in msg.metrics.items() if math.isfinite(v)})

    # ----- metrics sinks ------------------------------------------------------------------------

    def emit(self, row: dict[str, Any]) -> None:
        """Give a committed metrics row to the sinks; metrics.jsonl failing to take it ends the run."""
        try:
            self.sinks.write(row)
        except SinkFailed as exc:
            self.end_run_failed(f"{exc}; {exc.hint}")

    def sink_event(self, kind: str, detail: str) -> None:
        """Record a metric sink's failure or recovery as an event (`status`, the dashboard, `up`)."""
        with self.store.write():
            self.store.add_event(kind, detail[:1000])

    def rewrite_lost_rows(self) -> None:
        """Give the sinks the step rows a kill between a step's commit and its sink writes kept from
        metrics.jsonl (metrics/recovery.py)."""
        from astraflow.metrics.recovery import lost_rows

        rows = lost_rows(self.store, self.run_dir / "metrics.jsonl")
        if rows:
            _log.info("rewriting %d metrics rows missing from metrics.jsonl", len(rows))
            with self.store.write():
                self.store.add_event("metrics_rewritten", f"{len(rows)} step rows from state.db")
        for row in rows:
            self.emit(row)

    def end_run_failed(self, reason: str) -> None:
        """End the run with exit 1 (members are told to stop); the first reason is kept."""
        if self.failed is not None:
            return
        self.failed = reason
        self.finished_at = time.time()
        with self.store.write():
            self.store.add_event("run_failed", reason[:1000])
        _log.error("%s; ending the run", reason)

    # ----- the loop -----------------------------------------------------------------------------

    def should_exit(self, now: float) -> bool:
        """After the run's end: once every member left, or after a grace period."""
        if self.finished_at is None:
            return False
        if not self.store.members("alive"):
            return True
        grace = max(10.0, 4 * self.recipe.controller.member_timeout_s)
        if self.failed is not None:
            # members learn of the end from their next heartbeat; nothing more is worth waiting for
            grace = 4 * self.recipe.controller.heartbeat_interval_s + 1.0
        return now - self.finished_at > grace

    def _handle_safely(
        self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None
    ) -> m.Msg | None:
        try:
            return self.handle(ident, msg, principal)
        except Exception as exc:  # a bad request must never take the controller down
            _log.exception("handling %s from %r failed", type(msg).__name__, ident)
            return m.Error(rid=getattr(msg, "rid", 0), code="internal", message=str(exc)[:500])

    def dispatch(
        self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None = None
    ) -> list[tuple[bytes, m.Msg]]:
        """Handle one message; the replies to send now: its own (unless it was parked, roles/parked.py)
        and those of parked requests whose answer it may have changed."""
        reply = self._handle_safely(ident, msg, principal)
        now = time.time()
        out: list[tuple[bytes, m.Msg]] = []
        if isinstance(msg, m.BatchRequest | m.TaskRequest):
            if may_park(msg, reply):
                self.parked.park(ident, principal, msg, now)
                reply = None
            else:
                # a newer request of the same kind supersedes a held one (its sender stopped waiting)
                held = self.parked.batches if isinstance(msg, m.BatchRequest) else self.parked.tasks
                held.pop(ident, None)
        elif isinstance(msg, m.Hello) and isinstance(reply, m.Welcome):
            # a member joining (again) starts afresh: what it had held from before is void; its client
            # already failed those requests, and a late answer would grant tasks to nobody
            self.parked.drop(ident)
        if reply is not None:
            out.append((ident, reply))
        if not self.parked:
            return out
        if (
            isinstance(msg, m.TaskResult) and isinstance(reply, m.ResultAck) and reply.status == "accepted"
        ) or (isinstance(reply, m.ResultsAck) and any(a.status == "accepted" for a in reply.acks)):
            out += self.wake(("batch",), now)
        elif isinstance(msg, m.BatchRequest) and isinstance(reply, m.BatchReply) and reply.ready:
            out += self.wake(("task",), now)
        elif isinstance(msg, m.VersionPublished) and isinstance(reply, m.Ack) and reply.detail == "recorded":
            # workers hear of the version at once: they pull it, then ask again with it loaded
            out += self.wake(("task",), now, answer_all=True)
        elif isinstance(msg, m.Bye | m.Control | m.Leave):
            out += self.wake(("batch", "task"), now, answer_all=True)
        return out

    def wake(
        self, kinds: tuple[str, ...], now: float, *, expired_only: bool = False, answer_all: bool = False
    ) -> list[tuple[bytes, m.Msg]]:
        """Handle parked requests of these kinds again; returns the replies to send (a request whose
        answer is still "nothing yet" stays parked until its deadline, unless `answer_all`)."""
        out: list[tuple[bytes, m.Msg]] = []
        queue = list(kinds)
        while queue:
            kind = queue.pop(0)
            expired, rest = self.parked.take(kind, now, everything=answer_all)
            if expired_only:
                self.parked.put_back(rest)
                rest = []
            if kind == "batch":
                # a batch cannot be ready before enough fresh sequences are buffered: one COUNT, not a batch attempt
                ready = [p for p in rest if self._batch_may_be_ready(p)]
                self.parked.put_back([p for p in rest if p not in ready])
                rest = ready
            keep: list[Parked] = []
            for p in expired + rest:
                reply = self._handle_safely(p.ident, immediate(p.msg), p.principal)
                if p in rest and reply is not None and may_park(p.msg, reply):
                    keep.append(p)
                    continue
                if reply is not None:
                    out.append((p.ident, reply))
                if (
                    kind == "batch"
                    and isinstance(reply, m.BatchReply)
                    and reply.ready
                    and "task" not in queue
                ):
                    queue.append("task")  # a batch taken makes room for more tasks
            self.parked.put_back(keep)
        return out

    def _batch_may_be_ready(self, parked: Parked) -> bool:
        """Whether the policy of a parked BatchRequest has at least a batch's fresh sequences buffered."""
        policy = getattr(parked.msg, "policy", "")
        try:
            pol = self.recipe.get_policy(policy)
        except KeyError:
            return True  # answered with its error at once
        need = self.pipeline.fresh_per_batch(policy, pol.batch_prompts * pol.group_size)
        have = self.store.scalar(
            "SELECT COUNT(*) FROM trajectories WHERE status = 'buffered' AND policy = ?", (policy,)
        )
        return int(have or 0) >= need

    def serve(self, server: Any) -> int:
        """Poll, dispatch, do periodic work; returns 0 on a signal or at the run's end, 1 if the run failed."""
        while not self.stop_requested:
            for ident, principal, msg in server.poll(int(TICK_S * 1000)):
                for to, reply in self.dispatch(ident, msg, principal):
                    server.send(to, reply)
            now = time.time()
            if now - self.last_tick >= TICK_S:
                self.last_tick = now
                self.tick(now)
                for to, reply in self.wake(("batch", "task"), now, expired_only=True):
                    server.send(to, reply)
                if self.should_exit(now):
                    _log.info("run finished; exiting")
                    break
        self.pipeline.save()
        self.sinks.close()
        if self.failed is not None:
            _log.error("run failed: %s", _summary(self.failed))
            return 1
        return self.exit_code


def with_trainer_metrics(row: dict[str, Any], trainer: dict[str, float]) -> dict[str, Any]:
    """The controller's row plus the trainer's metrics; a trainer metric named like one of the
    controller's keeps its own value as `trainer/<name>`, so each name has one definition."""
    for k, v in trainer.items():
        name = f"trainer/{k}" if k in row and f"trainer/{k}" not in trainer else k
        row.setdefault(name, float(v))
    return row


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


def _summary(text: str) -> str:
    """The last non-empty line of an error (a traceback's summary line), capped."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def run_controller(
    recipe: Recipe, run_dir: Path, bind: str | None = None, *, allow_recipe_change: bool = False
) -> int:
    """Run the controller on `run_dir` (resuming its state.db) until SIGTERM/SIGINT or the run's end."""
    from astraflow.transport.server import RouterServer

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store.open(run_dir / "state.db", synchronous=recipe.controller.synchronous)
    server = None
    try:
        ctl = Controller(recipe, run_dir, store, allow_recipe_change=allow_recipe_change)
        ctl.start()
        server = RouterServer(
            bind or recipe.controller.bind, max_message_bytes=recipe.controller.max_message_bytes
        )

        def on_signal(signum: int, _frame: Any) -> None:
            ctl.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        tmp = run_dir / "controller.addr.tmp"
        tmp.write_text(server.address + "\n")
        tmp.replace(run_dir / "controller.addr")
        _log.info("controller of run %s listening on %s", recipe.run.name, server.address)
        return ctl.serve(server)
    finally:
        if server is not None:
            server.close()
        store.close()

"""The controller's IO: route each message to its handler, hold long polls, and run the loop.

It is the only writer of state.db. Each message is handled in its own transaction (the results
messages read in one poll share one, coalesce.py), and a reply is sent only after it committed, so
whatever a member was told is on disk. A handler returns an `Outcome` (outcome.py): `dispatch` sends
its reply (or holds the request) and hands its events to the long polls, whose answers it sends too.
Periodic work (liveness, lease expiry, refilling the queue) runs between polls (lifecycle.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

from astraflow import log
from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError
from astraflow.roles import authz
from astraflow.roles.controller import batches, beats, lifecycle, members, results, tasks, versions
from astraflow.roles.controller.beat_pace import BeatPace
from astraflow.roles.controller.coalesce import Coalescer
from astraflow.roles.controller.core import ControllerCore
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.parked import Parked, immediate
from astraflow.roles.controller.run_end import summary
from astraflow.roles.run_control import on_control
from astraflow.state.status import build_status
from astraflow.state.store import Store
from astraflow.transport.principal import Principal

_log = log.get("controller")

TICK_S = 0.1
"""Seconds between rounds of periodic work (and the poll timeout)."""


class Controller(ControllerCore):
    """The controller's state (core.py) with its message routing; `serve` runs the loop until stopped
    or the run ends."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, store: Store, *, allow_recipe_change: bool = False
    ) -> None:
        super().__init__(recipe, run_dir, store, allow_recipe_change=allow_recipe_change)
        self.loop = lifecycle.LoopState()
        """Whether to stop (a signal, a stall) and with which exit code; when the loop last ticked."""
        self._hand_over(recipe, run_dir, store)
        self.coalescer = Coalescer(self.dispatch, self._results_sender, self._take_merged, self._deliver)
        """A poll's messages dispatched in order, its results messages taken as one (coalesce.py)."""

    def _hand_over(self, recipe: Recipe, run_dir: Path, store: Store) -> None:
        """Give each member message's handler the parts of the state it reads, once (a flood of
        messages must not rebuild them): keywords, or one context per concern."""
        rc, cc = recipe.rollout, recipe.controller
        self.pace = BeatPace(cc.heartbeat_interval_s, cc.idle_beats_per_s)
        """The idle interval members are told, set by how many are alive (beat_pace.py)."""
        self._joining = members.Joining(
            store=store,
            ledger=self.ledger,
            members=self.members,
            draining=self.draining,
            versions=self.policy_versions,
            sections=self.welcome,
            run_name=recipe.run.name,
            policies=[p.name for p in recipe.policy],
            member_timeout_s=cc.member_timeout_s,
            heartbeat_interval_s=cc.heartbeat_interval_s,
            pace=self.pace,
        )
        """The Hello's handler's parts."""
        self.beats = beats.Beats(
            self.members,
            self.policy_versions,
            self.run,
            partial(
                members.on_heartbeat,
                store=store,
                ledger=self.ledger,
                members=self.members,
                accounting=self.accounting,
                versions=self.policy_versions,
                run=self.run,
                lease_max_age_s=rc.lease_max_age_s or rc.task_timeout_s + rc.lease_timeout_s,
            ),
            heartbeat_interval_s=cc.heartbeat_interval_s,
            pace=self.pace,
            held=self.parked.held_rids,
        )
        """Heartbeats (beats.py): the rate limit, an idle beat from memory, the rest through
        members.on_heartbeat (the rids of the member's held requests added per message)."""
        policies: dict[str, PolicyConfig] = {}
        for p in recipe.policy:
            policies.setdefault(p.name, p)
        self._batching = batches.Batching(
            policies=policies,
            budgets={name: recipe.budget(name) for name in policies},
            batch_part_bytes=cc.batch_part_bytes,
            store=store,
            buffer=self.buffer,
            pipeline=self.pipeline,
            queue=self.queue,
            progress=self.progress,
            run=self.run,
        )
        leasing = tasks.Leasing(
            store=store,
            ledger=self.ledger,
            admission=self.admission,
            control=self.control,
            evals=self.evals,
            queue=self.queue,
            shapes=self.shapes,
            members=self.members,
            accounting=self.accounting,
            draining=self.draining,
            versions=self.policy_versions,
            run=self.run,
            group_sizes=self.group_sizes,
            default_slots=rc.slots,
            max_member_slots=cc.max_member_slots,
        )
        self._intake = intake = results.Intake(
            store=store,
            ledger=self.ledger,
            checker=self.checker,
            admission=self.admission,
            shapes=self.shapes,
            pipeline=self.pipeline,
            buffer=self.buffer,
            evals=self.evals,
            accounting=self.accounting,
            progress=self.progress,
            run=self.run,
        )
        self.archiver = versions.archiver_of(cc.retention, run_dir)
        """The retention passes' archiver process (controller.retention.archiver), started on the first pass."""
        publishing = versions.Publishing(
            store=store,
            versions=self.policy_versions,
            pipeline=self.pipeline,
            metrics=self.step_metrics,
            sinks=self.sinks,
            evals=self.evals,
            progress=self.progress,
            run=self.run,
            retention=cc.retention,
            run_dir=run_dir,
            archiver=self.archiver,
        )
        self._handlers = cast(
            "dict[type, Callable[[dict[str, Any], Any], Outcome]]",
            {
                m.Bye: partial(
                    members.on_bye,
                    store=self.store,
                    ledger=self.ledger,
                    members=self.members,
                    draining=self.draining,
                ),
                m.TaskRequest: partial(tasks.on_task_request, leasing),
                m.TaskResult: partial(results.on_task_result, intake),
                m.TaskResults: partial(results.on_task_results, intake),
                m.BatchRequest: partial(batches.on_batch_request, self._batching),
                m.VersionPublished: partial(versions.on_version, publishing),
            },
        )
        """The member messages' handlers (but Heartbeat's), each taking the message type it is keyed by
        and only the parts of the state it reads (built once: a flood must not rebuild them per message)."""
        self._starting = lifecycle.Starting(
            recipe=recipe,
            allow_recipe_change=self.allow_recipe_change,
            store=store,
            members=self.members,
            evals=self.evals,
            sinks=self.sinks,
            run=self.run,
            queue=self.queue,
            run_dir=run_dir,
        )
        stalls = lifecycle.Stalls(
            recipe=recipe,
            store=store,
            admission=self.admission,
            buffer=self.buffer,
            ledger=self.ledger,
            roles=self.roles,
            group_sizes=self.group_sizes,
            task_policies=self.task_policies,
            progress=self.progress,
            warn_s=cc.stall_warn_s,
            fail_s=cc.stall_fail_s,
        )
        self._ticking = lifecycle.Ticking(
            store=store,
            ledger=self.ledger,
            members=self.members,
            accounting=self.accounting,
            versions=self.policy_versions,
            run=self.run,
            control=self.control,
            queue=self.queue,
            evals=self.evals,
            sinks=self.sinks,
            progress=self.progress,
            stalls=stalls,
            loop=self.loop,
            member_timeout_s=cc.member_timeout_s,
            heartbeat_interval_s=cc.heartbeat_interval_s,
            forget_after_s=cc.forget_after_s,
            pace=self.pace,
        )
        """The periodic work's parts (lifecycle.py)."""

    def start(self) -> None:
        """Record the run (or read it back on restart) and give surviving members a fresh timer."""
        lifecycle.start(self._starting)

    def tick(self, now: float | None = None) -> None:
        """Liveness, lease expiry, queue refill, end-of-run bookkeeping (lifecycle.py); the held
        requests of members it declared dead die with them."""
        for mid in lifecycle.tick(self._ticking, now):
            self.parked.drop(mid.encode())
            self.beats.forget(mid.encode())
        self.pace.update(len(self.members.seen))
        versions.take_archived(self.store, self.archiver)

    def close_archiver(self) -> None:
        """Finish the retention pass in flight and end the archiver process (versions.py)."""
        versions.close_archiver(self.store, self.archiver)

    # ----- routing ------------------------------------------------------------------------------

    def handle(
        self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None = None
    ) -> m.Msg | None:
        """The reply to one message (None: no reply); `principal` is the sender's key (None: auth off).
        Only the reply: `dispatch` also delivers the events the message caused."""
        return self.outcome(ident, msg, principal).reply

    def outcome(self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None = None) -> Outcome:
        """Handle one message: its reply and the events it caused (outcome.py); sends nothing."""
        if isinstance(msg, DecodeError):
            code = getattr(msg, "code", "bad_message")
            return Outcome(m.Error(rid=msg.rid, code=code, message=str(msg)[:500]))
        member_id = ident.decode("utf-8", "replace")
        rid = msg.rid
        if isinstance(msg, m.Hello):
            return members.on_hello(self._joining, ident, msg, principal)
        if isinstance(msg, m.StatusRequest):
            self.flush_touches()
            room = self.admission.room(self.roles, self.group_sizes)
            return Outcome(m.StatusReply(rid=rid, status=build_status(self.store, room)))
        if isinstance(msg, m.Leave):
            return members.on_leave(msg, principal, store=self.store, draining=self.draining)
        if isinstance(msg, m.Control):
            return self._on_control(msg, principal)
        member = self._alive_row(member_id)
        if member is None:
            return Outcome(
                m.Error(rid=rid, code="unknown_member", message=f"{member_id!r} has not joined; send Hello")
            )
        refused = authz.message_refusal(member, msg, principal)
        if refused is not None:
            _log.warning("refused %s from %r: %s", type(msg).__name__, member_id[:64], refused[1])
            return Outcome(m.Error(rid=rid, code=refused[0], message=refused[1]))
        if isinstance(msg, m.Heartbeat):
            # the held requests are the IO side's: the handler gets their rids as data
            held = self.parked.held_rids(ident)
            return self.beats.handle(ident, member, msg, held=held, now=time.time())
        # each handler takes the message type it is keyed by
        handler = self._handlers.get(type(msg))
        if handler is None:
            return Outcome(
                m.Error(
                    rid=rid,
                    code="unexpected_message",
                    message=f"the controller does not take {type(msg).__name__}",
                )
            )
        return handler(member, msg)

    def _on_control(self, msg: m.Control, principal: Principal | None) -> Outcome:
        """An operator's pause, resume or stop (roles/run_control.py); one that was applied changes
        the run for every held request."""
        done: list[str] = []

        def applied(action: str) -> None:
            if action == "resume":
                self.made_progress()  # the paused time is not a stall
                self.refill()
            done.append(action)

        names = [p.name for p in self.recipe.policy]
        reply = on_control(
            msg, principal, store=self.store, control=self.control, policies=names, applied=applied
        )
        return Outcome(reply, (Event.RUN_CHANGED,) if done else ())

    def _alive_row(self, member_id: str) -> dict[str, Any] | None:
        """The member's kept row if it joined and is alive (roles/member_table.py: the row is dropped
        whenever a statement changes it)."""
        member = self.members.row(member_id)
        return member if member is not None and member["status"] == "alive" else None

    def _results_sender(self, ident: bytes, msg: m.Msg, principal: Principal | None) -> dict[str, Any] | None:
        """The member whose results message this is, if `outcome` would hand it to the results handler
        (a joined, alive member whose key may send it); None: it is answered on its own."""
        member = self._alive_row(ident.decode("utf-8", "replace"))
        if member is None or authz.message_refusal(member, msg, principal):
            return None
        return member

    def _take_merged(self, senders: list[dict[str, Any]], msg: m.TaskResults) -> Outcome | None:
        """Several messages' results as one TaskResults, result i from senders[i] (coalesce.py); None
        if handling it failed (its group rolled back: each message is then answered `internal`)."""
        try:
            return results.take_results(self._intake, senders, msg)
        except Exception:
            _log.exception(
                "taking %d merged results failed; each of their messages is answered internal", len(senders)
            )
            return None

    def _handle_safely(self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None) -> Outcome:
        try:
            return self.outcome(ident, msg, principal)
        except Exception as exc:  # a bad request must never take the controller down
            _log.exception("handling %s from %r failed", type(msg).__name__, ident)
            return Outcome(m.Error(rid=getattr(msg, "rid", 0), code="internal", message=str(exc)[:500]))

    # ----- long polls ---------------------------------------------------------------------------

    def dispatch(
        self, ident: bytes, msg: m.Msg | DecodeError, principal: Principal | None = None
    ) -> list[tuple[bytes, m.Msg]]:
        """Handle one message; the replies to send now: its own (unless it was held, long_polls.py)
        and those of held requests the events it caused may answer."""
        if type(msg) is m.Heartbeat:  # thousands of members beat: an idle beat skips the routing
            try:
                idle = self.beats.idle(ident, msg, principal, time.time())
            except Exception:  # the general path below answers it (and logs what failed)
                idle = None
            if idle is not None:
                return idle
        done = self._handle_safely(ident, msg, principal)
        if done.void is not None:
            self.parked.drop(done.void)
            self.beats.forget(done.void)
        reply = self.polls.hold(ident, principal, msg, done.reply, time.time())
        return ([(ident, reply)] if reply is not None else []) + self._deliver(done)

    def _deliver(self, done: Outcome) -> list[tuple[bytes, m.Msg]]:
        """The replies of held requests that a handled message's events answer."""
        if not done.events:
            return []
        return self.polls.deliver(done.events, time.time(), self._answer, self._may_be_ready)

    def wake(
        self, kinds: tuple[str, ...], now: float, *, expired_only: bool = False, answer_all: bool = False
    ) -> list[tuple[bytes, m.Msg]]:
        """Handle held requests of these kinds again; returns the replies to send (a request whose
        answer is still "nothing yet" stays held until its deadline, unless `answer_all`)."""
        return self.polls.wake(
            kinds, now, self._answer, self._may_be_ready, expired_only=expired_only, answer_all=answer_all
        )

    def _answer(self, parked: Parked) -> Outcome:
        return self._handle_safely(parked.ident, immediate(parked.msg), parked.principal)

    def _may_be_ready(self, parked: Parked) -> bool:
        return batches.batch_may_be_ready(self._batching, parked)

    # ----- the loop -----------------------------------------------------------------------------

    def serve(self, server: Any) -> int:
        """Poll, dispatch, do periodic work; returns 0 on a signal or at the run's end, 1 if the run failed."""
        while not self.loop.stop_requested:
            for to, reply in self.coalescer.replies(server.poll(int(TICK_S * 1000))):
                server.send(to, reply)
            self.loop.backlogged = not getattr(server, "drained", True)
            now = time.time()
            if now - self.loop.last_tick >= TICK_S:
                self.loop.last_tick = now
                self.tick(now)
                for to, reply in self.wake(("batch", "task"), now, expired_only=True):
                    server.send(to, reply)
                if lifecycle.should_exit(self._ticking, now):
                    _log.info("run finished; exiting")
                    break
        self.pipeline.save()
        self.sinks.close()
        if self.failed is not None:
            _log.error("run failed: %s", summary(self.failed))
            return 1
        return self.loop.exit_code

"""`astraflow launch ray`: the run's roles as Ray actors, supervised (and the RaaS pool autoscaled) by
this process, the driver.

The driver attaches to a running Ray cluster (`--address`, or RAY_ADDRESS as `ray job submit` sets
it) or starts a local one, then places one actor per role (`ray_role.RoleProcess`: the actor runs the
role's `astraflow` command as its child; `ray_placement` says where and how): the controller first
(bound to all interfaces of its node; members get its node's address), then one trainer per trainable
policy and the RaaS workers. The run directory (state, keys, logs, checkpoints) must be on a
filesystem every node sees.

Supervision is the driver's loop, as in `astraflow up`, under the same restart policy
(launch/restarts.py): a RaaS actor that dies (its process killed, its node lost) is replaced under the
same member name, a trainer restarts from its checkpoint, and the run ends when every trainer has
finished (the controller then stops the workers and exits). With `rollout.autoscale.enabled` the loop
also reads the controller's demand and adds or drains workers (`autoscale.Autoscaler`).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.cluster.plan import Member, Plan
from astraflow.cluster.ray_placement import Placement, RayOptions
from astraflow.cluster.ray_role import RoleProcess
from astraflow.errors import AstraflowError
from astraflow.launch.autoscale import Autoscaler, overdue
from astraflow.launch.restarts import restart_rules, rule_for

_log = log.get("launch")


@dataclass
class Slot:
    """One member's actor (the current incarnation) and its bookkeeping."""

    member: Member
    actor: Any = None
    ref: Any = None
    """ObjectRef of the actor's wait(): ready when the role exits or the actor dies."""
    pg: Any = None
    restarts: int = 0
    draining: bool = False
    drain_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class RayRun:
    """One run on a Ray cluster: start, supervise, autoscale, stop."""

    def __init__(self, recipe: Any, plan: Plan, opts: RayOptions, raas_names: list[str]) -> None:
        import ray

        self.ray: Any = ray
        self.recipe = recipe
        self.plan = plan
        self.opts = opts
        self.raas_names = raas_names
        """Every RaaS member name with a key (the autoscaler's pool, min to max)."""
        self.slots: dict[str, Slot] = {}
        self.controller: Slot | None = None
        self.address = ""
        self.actor_cls: Any = ray.remote(RoleProcess)
        self.place = Placement(ray, plan, opts)
        self.rules = restart_rules(recipe, opts.max_restarts)
        self.autoscaler = Autoscaler(recipe.rollout.autoscale) if recipe.rollout.autoscale.enabled else None
        self.client: Any = None
        self.stop_signal = 0
        self.last_status: dict[str, Any] | None = None

    # ----- placing roles ------------------------------------------------------------------------

    def spawn(self, slot: Slot, argv: list[str], timeout_s: float | None = None) -> None:
        """Start (or replace) the member's actor and its role, placed within timeout_s (default
        start_timeout_s)."""
        timeout_s = self.opts.start_timeout_s if timeout_s is None else timeout_s
        if slot.actor is not None:
            self.ray.kill(slot.actor)  # a role that exited leaves its actor alive: release it first
            slot.actor = None
        opts, slot.pg = self.place.actor_options(slot.member, slot.pg, timeout_s)
        actor = self.actor_cls.options(**opts).remote(
            slot.member.name, argv, self.place.env(slot.member), str(self.plan.run_dir), str(Path.cwd())
        )
        try:
            slot.info = self.ray.get(actor.start.remote(), timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(actor)
            raise AstraflowError(
                f"{slot.member.name} was not placed on the Ray cluster within {timeout_s:.0f}s",
                hint=f"it needs {self.opts.cpus_per_role:g} CPU (--cpus-per-role); `ray status` shows what is free",
            ) from None
        except self.ray.exceptions.RayError as exc:
            self.ray.kill(actor)
            raise AstraflowError(
                f"{slot.member.name} did not start: {str(exc).splitlines()[0][:300]}",
                hint="is astraflow installed in the Python the Ray nodes run?",
            ) from None
        slot.actor = actor
        slot.ref = actor.wait.remote()
        slot.draining = False
        _log.info("%s started on %s (pid %s)", slot.member.name, slot.info["node"], slot.info["pid"])

    def start(self) -> None:
        """The controller, then the trainers and the starting RaaS workers."""
        addr_file = self.plan.run_dir / "controller.addr"
        addr_file.unlink(missing_ok=True)
        ctl = Slot(Member("controller", "controller"))
        self.controller = ctl
        self.spawn(ctl, self.place.argv(ctl.member, ""))
        try:
            self.address = self.ray.get(ctl.actor.address.remote(self.opts.start_timeout_s))
        except self.ray.exceptions.RayTaskError as exc:
            raise AstraflowError(
                f"the controller did not start: {exc.cause if hasattr(exc, 'cause') else exc}",
                hint=f"its log: {self.plan.run_dir / 'logs' / 'controller.log'}",
            ) from None
        _log.info("controller at %s; run directory %s", self.address, self.plan.run_dir)
        self.client = self._client()
        for m in self.plan.trainers:
            self.slots[m.name] = Slot(m)
            self.spawn(self.slots[m.name], self.place.argv(m, self.address))
        for m in self.plan.raas:
            self.add_worker(m.name)

    def _client(self) -> Any:
        """The operator client (status, drain) with the run's operator key."""
        from astraflow.transport.control_client import ControlClient
        from astraflow.transport.keys import load_keypair, load_public
        from astraflow.transport.security import MemberCredentials

        creds = MemberCredentials(
            keypair=load_keypair(self.plan.secret("operator")),
            controller_public=load_public(str(self.plan.keys / "controller.key")),
        )
        return ControlClient(self.address, creds, timeout_s=10.0)

    def add_worker(self, name: str | None = None, timeout_s: float | None = None) -> str:
        """Start a RaaS worker (the lowest free member name when none is given); one that cannot be
        placed is forgotten and the error raised."""
        if name is None:
            free = [n for n in self.raas_names if n not in self.slots]
            if not free:
                raise AstraflowError("no RaaS key left", hint="raise rollout.autoscale.max")
            name = free[0]
        slot = Slot(Member(name, "raas"))
        self.slots[name] = slot
        try:
            self.spawn(slot, self.place.argv(slot.member, self.address), timeout_s)
        except AstraflowError:
            self._forget(slot)
            raise
        return name

    # ----- supervision --------------------------------------------------------------------------

    def workers(self) -> list[Slot]:
        """The RaaS workers the driver runs."""
        return [s for s in self.slots.values() if s.member.role == "raas"]

    def supervise(self) -> int:
        """Watch every role until the run ends; returns the exit code."""
        trainers_left = {m.name for m in self.plan.trainers}
        next_scale = time.monotonic()
        while True:
            if self.stop_signal:
                _log.info("signal %d: stopping the run", self.stop_signal)
                return 128 + self.stop_signal
            refs = {
                s.ref: s
                for s in [*self.slots.values(), self.controller]
                if s is not None and s.ref is not None
            }
            if not refs:
                return 1
            ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=1.0)
            for ref in ready:
                slot = refs[ref]
                slot.ref = None
                rc = self._exit_code(ref)
                code = self._exited(slot, rc, trainers_left)
                if code is not None:
                    return code
            if not trainers_left:
                return 0
            if time.monotonic() >= next_scale and self.address:
                next_scale = time.monotonic() + self.recipe.rollout.autoscale.interval_s
                self._scale()

    def _exit_code(self, ref: Any) -> int | None:
        """The role's exit code, or None when its actor died (killed, node lost)."""
        try:
            return int(self.ray.get(ref))
        except self.ray.exceptions.RayError as exc:
            _log.warning("actor died: %s", str(exc).splitlines()[0][:200])
            return None

    def _exited(self, slot: Slot, rc: int | None, trainers_left: set[str]) -> int | None:
        """Handle one role's exit; returns the run's exit code when it ends the run."""
        name, role = slot.member.name, slot.member.role
        how = "its actor died" if rc is None else f"exit {rc}"
        if role == "controller":
            if rc == 0 or not trainers_left:
                # it exits 0 only once the run is over (budgets met, or `ctl stop`): the trainers may
                # still be writing their last checkpoint, which stop() waits for
                return 0
            _log.error(
                "the controller stopped (%s) before the trainers finished; see %s", how, self._log_of(name)
            )
            return 1
        if role == "trainer" and rc == 0:
            trainers_left.discard(name)
            _log.info("%s finished", name)
            return None
        if role == "raas" and (slot.draining or rc == 0 or not trainers_left):
            # drained, or told to stop by the controller at the run's end: not a failure
            _log.info("%s left (%s)", name, how)
            self._forget(slot)
            return None
        rule = rule_for(self.rules, role, name)
        others = any(
            s.ref is not None for s in self.slots.values() if s.member.role == role and s is not slot
        )
        step = rule.after(slot.restarts, others)
        if step == "fail":
            _log.error(
                "%s stopped (%s) after %d restarts; see %s", name, how, slot.restarts, self._log_of(name)
            )
            return 1
        if step == "spare":
            _log.warning("%s stopped (%s) after %d restarts: going on without it", name, how, slot.restarts)
            self._forget(slot)
            return None
        slot.restarts += 1
        _log.warning("%s stopped (%s): %s (%d/%d)", name, how, rule.how, slot.restarts, rule.limit)
        self.spawn(slot, self.place.argv(slot.member, self.address))
        return None

    def _forget(self, slot: Slot) -> None:
        """Drop a member's actor and its placement group."""
        self.slots.pop(slot.member.name, None)
        if slot.actor is not None:
            self.ray.kill(slot.actor)
        if slot.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(slot.pg)

    def _log_of(self, name: str) -> Path:
        return self.plan.run_dir / "logs" / f"{name}.log"

    # ----- autoscaling --------------------------------------------------------------------------

    def _scale(self) -> None:
        """Read the demand (also for /metrics) and let the autoscaler act on it."""
        from astraflow.transport.control_client import ask_status

        try:
            self.last_status = ask_status(self.address, timeout_s=5.0, credentials=self.client.credentials)
        except AstraflowError as exc:
            _log.warning("no status from the controller: %s", exc)
            return
        if self.autoscaler is None:
            return
        demand = self.last_status.get("demand", {})
        now = time.monotonic()
        draining = {s.member.name: s.drain_at for s in self.workers() if s.draining}
        for name in overdue(draining, now, self.recipe.rollout.drain_timeout_s):
            if self.slots[name].actor is not None:
                self.slots[name].actor.signal.remote(signal.SIGTERM)
        workers = [s.member.name for s in self.workers()]
        decision = self.autoscaler.decide_pool(demand, workers, draining, now)
        _log.debug(
            "autoscale: %s (%s); queued %s, slots %s/%s busy",
            decision.action,
            decision.reason,
            demand.get("queued"),
            demand.get("busy_slots"),
            demand.get("slots"),
        )
        if decision.action == "add":
            try:
                name = self.add_worker(timeout_s=min(self.opts.start_timeout_s, 60.0))
            except AstraflowError as exc:
                _log.warning("autoscale: cannot add a worker (%s): %s", decision.reason, exc.message)
                return
            _log.info("autoscale: added %s (%s)", name, decision.reason)
        elif decision.action == "remove":
            slot = self.slots[decision.member]
            slot.draining, slot.drain_at = True, now
            try:
                self.client.drain(decision.member)
            except AstraflowError as exc:
                _log.warning("autoscale: drain of %s refused (%s); sending SIGTERM", decision.member, exc)
                slot.actor.signal.remote(signal.SIGTERM)
            _log.info("autoscale: draining %s (%s)", decision.member, decision.reason)

    # ----- stopping -----------------------------------------------------------------------------

    def stop(self, graceful: bool) -> None:
        """Stop whatever still runs and release every actor and placement group. After a finished run
        (graceful) the controller stops the workers and exits by itself within stop_grace_s; then, or
        at once after a failure or a signal, workers get SIGTERM first (they drain), then trainers
        (they checkpoint), then the controller."""
        ray: Any = self.ray
        live = [s for s in [*self.slots.values(), self.controller] if s is not None and s.ref is not None]
        ctl = self.controller
        if graceful:
            # the controller tells the workers it knows to stop and exits once they have left; the
            # trainers may still be writing their last checkpoint
            if ctl is not None and ctl.ref is not None:
                ray.wait([ctl.ref], timeout=self.opts.stop_grace_s)
            trainers = [s.ref for s in live if s.member.role == "trainer"]
            if trainers:
                ray.wait(trainers, num_returns=len(trainers), timeout=30.0)
            if live:
                ready, _ = ray.wait([s.ref for s in live], num_returns=len(live), timeout=1.0)
                live = [s for s in live if s.ref not in ready]
        for role, wait_s in (
            ("raas", self.recipe.rollout.drain_timeout_s + 10),
            ("trainer", 30.0),
            ("controller", 30.0),
        ):
            group = [s for s in live if s.member.role == role and s.actor is not None]
            for s in group:
                s.actor.signal.remote(signal.SIGTERM)
            if group:
                ray.wait([s.ref for s in group], num_returns=len(group), timeout=wait_s)
        for left in [*self.slots.values(), self.controller]:
            if left is None or left.actor is None:
                continue
            try:
                ray.get(left.actor.kill.remote(), timeout=5)
            except ray.exceptions.RayError:
                pass
            self._forget(left)


def run_on_ray(recipe: Any, plan: Plan, opts: RayOptions, raas_names: list[str]) -> int:
    """Attach to (or start) a Ray cluster, run the recipe there, release everything; the exit code."""
    import ray

    address = opts.address or os.environ.get("RAY_ADDRESS", "")
    try:
        # no address: the cluster `ray start` last started on this machine, else a new local one
        ray.init(address=address or None, log_to_driver=False, namespace="astraflow")
    except (ConnectionError, RuntimeError) as exc:
        raise AstraflowError(
            f"cannot attach to the Ray cluster at {address or 'a new local one'}: {exc}",
            hint="is `ray start --head` running there? pass its address with --address (or RAY_ADDRESS)",
        ) from None
    run = RayRun(recipe, plan, opts, raas_names)
    old = {}

    def on_signal(signum: int, _frame: Any) -> None:
        run.stop_signal = signum

    for s in (signal.SIGINT, signal.SIGTERM):
        old[s] = signal.signal(s, on_signal)
    server = None
    code = 1
    try:
        if opts.metrics_bind:
            from astraflow.metrics.prometheus import serve

            server = serve(opts.metrics_bind, lambda: run.last_status)
        run.start()
        code = run.supervise()
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        try:
            run.stop(graceful=code == 0)
        finally:
            if server is not None:
                server.shutdown()
            ray.shutdown()

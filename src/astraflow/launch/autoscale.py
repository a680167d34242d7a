"""The autoscaler: one policy, shared by every backend, that sizes the RaaS pool from the controller's
demand (`status.demand`, astraflow.state.demand).

A worker is added while work waits: at least `up_queued` tasks are queued that a worker could lease
(`demand.waiting`: not those of policies whose admission an operator paused) and at least
`up_busy_fraction` of the alive workers' slots hold a lease (queued tasks with free slots wait on the
staleness bound, not on workers, and more workers would not help). A worker is removed while the pool
idles: at least `down_idle_fraction` of the slots hold no lease, whether or not tasks are queued
(a queued task that idle workers do not lease waits on something workers cannot give it: admission
paused by an operator, or newer weights under the staleness bound). Either condition must hold for
`window_s`, and changes are `cooldown_s` apart. Removal is a drain (the same
`Leave` as `astraflow ctl drain`): the worker takes no new task, finishes or hands back the ones it
holds, and says Bye, so nothing is lost. The backend acts (starts a process, an actor, a pod); this
module only decides, so it is tested without any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from astraflow.config.recipe import AutoscaleConfig


@dataclass(frozen=True)
class Decision:
    """What the backend should do now."""

    action: Literal["add", "remove", "hold"]
    reason: str
    member: str = ""
    """The worker to drain (remove)."""


@dataclass(frozen=True)
class _Load:
    """The pool's slots, the busy ones, the tasks waiting, and whether that is pressure or idling."""

    slots: int
    busy: int
    queued: int
    pressure: bool
    idle: bool


@dataclass
class Autoscaler:
    """Decides, one call at a time, whether to add or drain a RaaS worker."""

    config: AutoscaleConfig
    pressure_since: float | None = None
    idle_since: float | None = None
    last_change: float = field(default=float("-inf"))

    def decide(self, demand: dict[str, Any], workers: list[str], pending: int, now: float) -> Decision:
        """The next step for a pool of `workers` (member ids the backend runs and has not asked to
        drain) given the controller's demand; `pending` counts workers started that have not joined
        yet and workers draining that have not left: the pool is in motion, so nothing changes."""
        cfg = self.config
        count = len(workers)
        if count < cfg.min:
            return self._change("add", f"{count} workers, fewer than min {cfg.min}", now)
        if count > cfg.max:
            return self._change("remove", f"{count} workers, more than max {cfg.max}", now, demand, workers)
        load = self._observe(demand, now)
        if pending:
            return Decision("hold", f"{pending} worker(s) starting or draining")
        if now - self.last_change < cfg.cooldown_s:
            return Decision("hold", "cooling down")
        if load.pressure and count < cfg.max and now - (self.pressure_since or now) >= cfg.window_s:
            return self._change(
                "add", f"{load.queued} tasks queued, {load.busy}/{load.slots} slots busy", now
            )
        if load.idle and count > cfg.min and now - (self.idle_since or now) >= cfg.window_s:
            reason = f"{load.slots - load.busy}/{load.slots} slots idle"
            return self._change("remove", reason, now, demand, workers)
        return Decision("hold", "within bounds")

    def _observe(self, demand: dict[str, Any], now: float) -> _Load:
        """The pool's load now; starts (or ends) the pressure and idle windows."""
        cfg = self.config
        slots = int(demand.get("slots") or 0)
        busy = int(demand.get("busy_slots") or 0)
        queued = int(demand.get("waiting", demand.get("queued")) or 0)
        pressure = queued >= cfg.up_queued and slots > 0 and busy >= cfg.up_busy_fraction * slots
        idle = slots > 0 and (slots - busy) >= cfg.down_idle_fraction * slots
        self.pressure_since = (
            (self.pressure_since if self.pressure_since is not None else now) if pressure else None
        )
        self.idle_since = (self.idle_since if self.idle_since is not None else now) if idle else None
        return _Load(slots, busy, queued, pressure, idle)

    def decide_pool(
        self, demand: dict[str, Any], workers: list[str], draining: Mapping[str, float], now: float
    ) -> Decision:
        """decide() for the workers a backend runs (`workers`, those draining included; `draining`:
        name -> when it was asked to leave): a worker draining, or started and not yet listed alive
        by the controller, puts the pool in motion."""
        alive = {w["id"] for w in demand.get("workers", [])}
        running = [w for w in workers if w not in draining]
        pending = sum(1 for w in workers if w in draining or w not in alive)
        return self.decide(demand, running, pending, now)

    def _change(
        self,
        action: Literal["add", "remove"],
        reason: str,
        now: float,
        demand: dict[str, Any] | None = None,
        workers: list[str] | None = None,
    ) -> Decision:
        self.last_change = now
        self.pressure_since = self.idle_since = None
        if action == "add":
            return Decision("add", reason)
        return Decision("remove", reason, idlest(demand or {}, workers or []))


def idlest(demand: dict[str, Any], workers: list[str]) -> str:
    """The worker to drain: the one holding the fewest leases (the newest of equals, which has the
    least warmed-up engine); a worker the controller does not list yet holds none."""
    leased = {w["id"]: int(w.get("leased", 0)) for w in demand.get("workers", [])}
    return min(reversed(workers), key=lambda w: leased.get(w, 0))


DRAIN_GRACE_S = 30.0
"""Beyond rollout.drain_timeout_s, how long a drained worker may take to leave before it gets SIGTERM."""


def overdue(draining: Mapping[str, float], now: float, drain_timeout_s: float) -> list[str]:
    """Workers asked to drain too long ago (the Leave did not reach them): a backend sends them
    SIGTERM, which drains too."""
    return [w for w, asked in draining.items() if now - asked > drain_timeout_s + DRAIN_GRACE_S]

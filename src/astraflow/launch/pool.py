"""The RaaS workers of `astraflow up`: started as children of the launcher and, with
`rollout.autoscale.enabled`, grown and drained with the controller's demand.

The policy is the one every backend shares (launch/autoscale.py); this module acts on it for local
children: it reads the live controller's demand with the run's operator key every `interval_s`,
starts a worker under the lowest free member name (`raas-0` … `raas-<max-1>`, a key made for each), or
drains one with the `Leave` of `astraflow ctl drain` (the worker takes no new task, finishes or hands
back the ones it holds, says Bye and exits 0: nothing is lost). A drained worker that is still there
`drain_timeout_s` + 30 s later gets SIGTERM, which drains it too (the Leave did not reach it). A worker that dies is restarted by
the launcher's restart policy (launch/restarts.py) like any other, unless the pool drained it.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError
from astraflow.launch.autoscale import Autoscaler, Decision, overdue
from astraflow.launch.supervisor import Child, Supervisor
from astraflow.metrics.role_stats import STATS_ENV

_log = log.get("launcher")


def worker_gpus(gpus: str, index: int, workers: int) -> str:
    """The GPUs of local RaaS worker `index`: with several workers and several GPUs listed, one GPU
    each in turn (worker i gets the (i mod n)-th); otherwise every listed GPU."""
    listed = [g for g in gpus.split(",") if g]
    if workers > 1 and len(listed) > 1:
        return listed[index % len(listed)]
    return gpus


def pool_names(rollout: Any) -> list[str]:
    """Every member name a local worker may have (the starting ones, and up to autoscale.max)."""
    scale = rollout.autoscale
    return [f"raas-{i}" for i in range(max(rollout.local_workers, scale.max if scale.enabled else 0))]


def check_bounds(rollout: Any) -> None:
    """An autoscaled pool starts within its bounds."""
    scale = rollout.autoscale
    if scale.enabled and not scale.min <= rollout.local_workers <= scale.max:
        raise AstraflowError(
            f"rollout.local_workers ({rollout.local_workers}) is outside rollout.autoscale.min..max "
            f"({scale.min}..{scale.max})",
            hint="set rollout.local_workers within the bounds, or change them",
        )


class LocalPool:
    """The local RaaS children of one `up`, and the autoscaler acting on them."""

    def __init__(
        self, sup: Supervisor, rollout: Any, run_dir: Path, keys: dict[str, list[str]], at: list[str]
    ) -> None:
        self.sup, self.rollout, self.run_dir, self.keys, self.at = sup, rollout, run_dir, keys, at
        self.names = pool_names(rollout)
        self.autoscaler = Autoscaler(rollout.autoscale) if rollout.autoscale.enabled else None
        self.draining: dict[str, float] = {}
        """Workers asked to leave (by name), with when; a drained worker's exit is not a failure."""
        self.drained: set[int] = set()
        """Process ids of workers the pool drained."""
        self.next_at = 0.0
        self.address = ""
        self.credentials: Any = None

    def start(self, name: str) -> Child:
        """Start (or start again, after a drain) the worker `name`."""
        index = self.names.index(name)
        env = {
            **self._gpus(index),
            # each worker appends its engines' busy time and weight loads here (docs/benchmarks.md)
            STATS_ENV: str(self.run_dir / "logs" / f"{name}.stats.jsonl"),
        }
        args = ["join", "--role", "raas", *self.at, "--member-id", name]
        args += ["--slots", str(self.rollout.slots), *self.keys[name]]
        old = next((c for c in self.sup.children if c.name == name), None)
        if old is None:
            return self.sup.start(name, "raas", args, env=env)
        self.sup.respawn(old)
        return old

    def _gpus(self, index: int) -> dict[str, str]:
        gpus = worker_gpus(self.rollout.gpus, index, len(self.names))
        return {"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}

    def was_drained(self, child: Child) -> bool:
        """The child's process is one the pool drained: its exit is a departure, not a failure."""
        return child.proc is not None and child.proc.pid in self.drained

    def watch(self, address: str, now: float | None = None) -> None:
        """Every interval_s: read the demand and add or drain one worker as the autoscaler says."""
        if self.autoscaler is None or not any(
            c.role == "controller" and c.running for c in self.sup.children
        ):
            return  # a controller that exited (the run is over) has no demand to read
        now = time.monotonic() if now is None else now
        if now < self.next_at:
            return
        self.next_at = now + self.rollout.autoscale.interval_s
        demand = self._demand(address)
        if demand is None:
            return
        workers = {c.name: c for c in self.sup.children if c.role == "raas" and c.running}
        self._terminate_overdue(workers, now)
        self._act(self.autoscaler.decide_pool(demand, list(workers), self.draining, now), workers, now)

    def _terminate_overdue(self, workers: dict[str, Child], now: float) -> None:
        """Forget the drained workers that left; SIGTERM those the Leave did not reach in time."""
        self.draining = {n: t for n, t in self.draining.items() if n in workers}
        for name in overdue(self.draining, now, self.rollout.drain_timeout_s):
            proc = workers[name].proc
            if proc is not None:
                proc.send_signal(signal.SIGTERM)

    def _act(self, decision: Decision, workers: dict[str, Child], now: float) -> None:
        """Start a worker under a free name (add) or drain the one named (remove)."""
        if decision.action == "add":
            free = [n for n in self.names if n not in workers]
            if free:
                self.start(free[0])
                _log.info("autoscale: added %s (%s)", free[0], decision.reason)
        elif decision.action == "remove":
            self._drain(decision.member, decision.reason, now)

    def _demand(self, address: str) -> dict[str, Any] | None:
        """The live controller's demand, or None (logged) when it does not answer."""
        from astraflow.transport.control_client import ask_status, operator_credentials

        keys = self.run_dir / "keys"
        if self.credentials is None:
            self.credentials = operator_credentials(
                keys / "members" / "operator.key_secret", str(keys / "controller.key")
            )
        try:
            return dict(ask_status(address, timeout_s=5.0, credentials=self.credentials)["demand"])
        except AstraflowError as exc:
            _log.warning("autoscale: no status from the controller: %s", exc.message)
            return None

    def _drain(self, name: str, reason: str, now: float) -> None:
        """Ask a worker to leave (SIGTERM, which drains too, when the controller refuses)."""
        from astraflow.transport.control_client import ControlClient

        child = next(c for c in self.sup.children if c.name == name and c.running)
        assert child.proc is not None
        self.draining[name] = now
        self.drained.add(child.proc.pid)
        try:
            ControlClient(self.address, self.credentials, timeout_s=10.0).drain(name)
        except AstraflowError as exc:
            _log.warning("autoscale: drain of %s refused (%s); sending SIGTERM", name, exc.message)
            child.proc.send_signal(signal.SIGTERM)
        _log.info("autoscale: draining %s (%s)", name, reason)

"""The RaaS pool of a Slurm run: with `rollout.autoscale.enabled`, the batch job's first node runs this
loop beside the controller (`python -m astraflow.cluster.slurm_pool`, started by the generated script).

It acts on the policy every backend shares (launch/autoscale.py): every `interval_s` it reads the live
controller's demand with the run's operator key; "add a worker" is `sbatch` of a one-RaaS job
(`RUN/launch/raas-<i>.sbatch`, written by `astraflow launch slurm` next to the main script, with the
same keys and run directory), "remove" is the drain of `astraflow ctl drain` (a `Leave`: the worker
takes no new task, finishes or hands back the ones it holds, says Bye and exits 0, so its job ends
COMPLETED). A drained worker still there `drain_timeout_s` + 30 s later gets SIGTERM (`scancel --full
--signal=TERM` for a job), which drains it too. Workers of the main job (its `srun` steps) are in the
pool as well and may be drained; a worker is only ever added as a job of its own.

The loop ends when the controller's process has exited (the run is over, or it failed); jobs it
submitted that still run then get SIGTERM, which drains them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError
from astraflow.launch.autoscale import Autoscaler, overdue

_log = log.get("pool")

LIVE_JOB_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"})
"""Job states (squeue %T) of a worker job that has not ended."""


@dataclass
class Worker:
    """One RaaS worker of the pool: a step of the main job (pid of its srun) or a job of its own."""

    name: str
    pid: int = 0
    job: str = ""
    drain_at: float | None = None


def worker_script(name: str) -> str:
    """The one-RaaS job script of worker `name`, relative to the run directory."""
    return f"launch/{name}.sbatch"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a child of ours that exited stays a zombie until reaped: reap it, or it looks alive
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


class SlurmPool:
    """The pool of one Slurm run and the autoscaler acting on it."""

    def __init__(
        self, run_dir: Path, controller: str, steps: dict[str, int], controller_pid: int, recipe: Any
    ) -> None:
        self.run_dir, self.controller, self.controller_pid = run_dir, controller, controller_pid
        self.rollout = recipe.rollout
        self.autoscaler = Autoscaler(self.rollout.autoscale)
        self.names = [f"raas-{i}" for i in range(max(len(steps), self.rollout.autoscale.max))]
        self.workers: dict[str, Worker] = {n: Worker(n, pid=p) for n, p in steps.items()}
        self.credentials: Any = None
        self.answered = False
        """The controller has answered once (before, it may still be starting: not worth a warning)."""

    # ----- what runs --------------------------------------------------------------------------

    def _job_states(self) -> dict[str, str]:
        """squeue's state of every job the pool submitted that Slurm still lists."""
        jobs = [w.job for w in self.workers.values() if w.job]
        if not jobs:
            return {}
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %T", "-j", ",".join(jobs)], capture_output=True, text=True
        )
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise AstraflowError(f"squeue failed: {out.stderr.strip()}")
        return dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())

    def refresh(self) -> None:
        """Forget workers whose step or job has ended (drained, told to stop, or failed)."""
        try:
            states = self._job_states()
        except AstraflowError as exc:
            _log.warning("autoscale: %s", exc.message)
            return
        for name, w in list(self.workers.items()):
            if w.job:
                live = states.get(w.job, "").strip() in LIVE_JOB_STATES
            else:
                live = _pid_alive(w.pid)
            if not live:
                how = "after its drain" if w.drain_at is not None else "without a drain"
                where = f"job {w.job}" if w.job else f"step pid {w.pid}"
                _log.info("autoscale: %s (%s) ended %s", name, where, how)
                del self.workers[name]

    # ----- acting -----------------------------------------------------------------------------

    def _client(self) -> Any:
        from astraflow.transport.control_client import ControlClient, operator_credentials

        if self.credentials is None:
            keys = self.run_dir / "keys"
            self.credentials = operator_credentials(
                keys / "members" / "operator.key_secret", str(keys / "controller.key")
            )
        return ControlClient(self.controller, self.credentials, timeout_s=10.0)

    def add(self, reason: str) -> None:
        """sbatch the one-RaaS job of the lowest free member name."""
        free = [n for n in self.names if n not in self.workers]
        if not free:
            return
        name = free[0]
        script = self.run_dir / worker_script(name)
        out = subprocess.run(
            ["sbatch", "--parsable", str(script), self.controller], capture_output=True, text=True
        )
        if out.returncode != 0:
            _log.warning("autoscale: sbatch of %s refused: %s", script, out.stderr.strip())
            return
        job = out.stdout.strip().split(";")[0]
        self.workers[name] = Worker(name, job=job)
        _log.info("autoscale: added %s as job %s (%s)", name, job, reason)

    def signal_term(self, w: Worker) -> None:
        """SIGTERM a worker (it drains): its srun step, or every process of its job."""
        if w.job:
            subprocess.run(["scancel", "--full", "--signal=TERM", w.job], capture_output=True)
        else:
            try:
                os.kill(w.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def drain(self, name: str, reason: str, now: float) -> None:
        """Ask a worker to leave (SIGTERM, which drains too, when the controller refuses)."""
        w = self.workers[name]
        w.drain_at = now
        try:
            self._client().drain(name)
        except AstraflowError as exc:
            _log.warning("autoscale: drain of %s refused (%s); sending SIGTERM", name, exc.message)
            self.signal_term(w)
        _log.info("autoscale: draining %s (%s)", name, reason)

    def step(self, now: float) -> None:
        """One look at the demand, and at most one change."""
        from astraflow.transport.control_client import ask_status

        self.refresh()
        self._client()
        try:
            status = ask_status(self.controller, timeout_s=5.0, credentials=self.credentials)
        except AstraflowError as exc:
            (_log.warning if self.answered else _log.debug)(
                "autoscale: no status from the controller: %s", exc.message
            )
            return
        self.answered = True
        demand = dict(status.get("demand", {}))
        draining = {n: w.drain_at for n, w in self.workers.items() if w.drain_at is not None}
        for name in overdue(draining, now, self.rollout.drain_timeout_s):
            self.signal_term(self.workers[name])
        decision = self.autoscaler.decide_pool(demand, list(self.workers), draining, now)
        if decision.action == "add":
            self.add(decision.reason)
        elif decision.action == "remove":
            self.drain(decision.member, decision.reason, now)

    def run(self) -> int:
        """Act every interval_s while the controller's process lives; then SIGTERM the jobs left."""
        stop = False

        def on_term(_signum: int, _frame: Any) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        _log.info(
            "autoscale: pool of %s, bounds %d..%d, controller %s",
            ", ".join(self.workers) or "no worker",
            self.rollout.autoscale.min,
            self.rollout.autoscale.max,
            self.controller,
        )
        while not stop and _pid_alive(self.controller_pid):
            self.step(time.monotonic())
            deadline = time.monotonic() + self.rollout.autoscale.interval_s
            while not stop and time.monotonic() < deadline:
                time.sleep(0.1)
        self.refresh()
        for w in self.workers.values():
            if w.job:
                _log.info("autoscale: stopping %s (job %s)", w.name, w.job)
                self.signal_term(w)
        return 0


def main(argv: list[str] | None = None) -> int:
    from astraflow.config.load import load_recipe

    p = argparse.ArgumentParser(
        prog="python -m astraflow.cluster.slurm_pool",
        description="Autoscale the RaaS workers of a Slurm run (started by its sbatch script).",
    )
    p.add_argument("--run-dir", required=True, type=Path, help="The run directory (shared filesystem).")
    p.add_argument("--controller", required=True, help="The controller's address, tcp://NODE:PORT.")
    p.add_argument("--controller-pid", required=True, type=int, help="The controller step's srun pid.")
    p.add_argument("--worker", action="append", default=[], help="NAME=PID of a worker step of the main job.")
    args = p.parse_args(argv)
    log.setup("pool")
    log.add_file(args.run_dir / "logs" / "pool.log")
    steps = {}
    for spec in args.worker:
        name, _, pid = spec.partition("=")
        steps[name] = int(pid)
    recipe = load_recipe(args.run_dir / "recipe.resolved.json")
    return SlurmPool(args.run_dir.resolve(), args.controller, steps, args.controller_pid, recipe).run()


if __name__ == "__main__":
    raise SystemExit(main())

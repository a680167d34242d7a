"""The children of one `astraflow up`: started in their own session with output to logs/NAME.log,
restarted on demand, and stopped in order (RaaS workers drain first, stragglers are killed).

Children run in their own session (so the terminal's Ctrl-C reaches only the launcher, which then
stops them in order) and ask the kernel to SIGTERM them if the launcher dies (no orphans).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from astraflow import log

_log = log.get("launcher")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def astraflow_cmd() -> list[str]:
    """How to start an `astraflow` child so that `ps` shows `astraflow <role> ...`."""
    script = Path(sys.executable).with_name("astraflow")
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "astraflow"]


@dataclass
class Child:
    """One supervised child process."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for this child only (its GPUs, its stats file)."""
    log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches and stops the children of one `up`."""

    def __init__(self, run_dir: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.children: list[Child] = []
        self.env = {**os.environ, **(env or {})}

    def start(self, name: str, role: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `astraflow ARGS` as a child whose output goes to logs/<name>.log (env: its own extra variables)."""
        child = Child(
            name=name,
            role=role,
            argv=astraflow_cmd() + args,
            log_path=self.run_dir / "logs" / f"{name}.log",
            env=env or {},
        )
        self._spawn(child)
        self.children.append(child)
        return child

    def start_command(self, name: str, role: str, argv: list[str], env: dict[str, str]) -> Child:
        """Start any command (a recipe's [[service]]) as a supervised child, output to logs/<name>.log."""
        child = Child(
            name=name, role=role, argv=argv, log_path=self.run_dir / "logs" / f"{name}.log", env=env
        )
        try:
            self._spawn(child)
        except OSError as exc:
            from astraflow.errors import AstraflowError

            if child.log_file is not None:
                child.log_file.close()
            raise AstraflowError(f"cannot start {name}: {exc}", hint="check its command") from None
        self.children.append(child)
        return child

    def _spawn(self, child: Child) -> None:
        child.log_file = open(child.log_path, "ab")  # noqa: SIM115 - closed in stop_all
        child.proc = subprocess.Popen(
            child.argv,
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**self.env, **child.env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        _log.debug("started %s pid %d: %s", child.name, child.proc.pid, " ".join(child.argv))

    def restart(self, child: Child) -> None:
        """Start a dead child again with the same command line (a service's leftover processes, which
        may still hold its port, are killed first)."""
        child.restarts += 1
        if child.role == "service" and child.proc is not None:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
            except (ProcessLookupError, PermissionError):
                pass
        if child.log_file is not None:
            child.log_file.close()
        self._spawn(child)

    def respawn(self, child: Child) -> None:
        """Start a child that left on purpose (a drained worker the autoscaler adds again) afresh: its
        restarts count anew."""
        child.restarts = 0
        if child.log_file is not None:
            child.log_file.close()
        self._spawn(child)

    def exited(self) -> list[tuple[Child, int]]:
        """Children that have exited since they were started, with their return codes."""
        out = []
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                out.append((c, c.proc.returncode))
        return out

    def stop_all(self, grace_s: float = 10.0, drain_s: float = 0.0) -> None:
        """SIGTERM the RaaS workers first and give them drain_s to finish or return their leases while
        the controller still runs; then the trainers and the controller; SIGKILL stragglers."""
        self._drain_workers(drain_s)
        order = {"raas": 0, "trainer": 1, "controller": 2, "service": 3}
        for c in sorted(self.children, key=lambda c: order.get(c.role, 0)):
            if c.running and c.proc is not None:
                _signal(c, signal.SIGTERM)
        self._reap(grace_s)
        for c in self.children:
            if c.log_file is not None:
                c.log_file.close()
                c.log_file = None

    def _drain_workers(self, drain_s: float) -> None:
        """SIGTERM the running RaaS workers and wait up to drain_s (+2 s) for them to exit."""
        workers = [c for c in self.children if c.role == "raas" and c.running and c.proc is not None]
        for c in workers:
            assert c.proc is not None
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + drain_s + 2.0
        for c in workers:
            assert c.proc is not None
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed by stop_all with the others if it does not stop within grace_s

    def _reap(self, grace_s: float) -> None:
        """Wait up to grace_s for every child to exit; SIGKILL those that do not."""
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _log.warning("%s did not stop within %.0fs; killing it", c.name, grace_s)
                _signal(c, signal.SIGKILL)
                c.proc.wait()


def _signal(child: Child, sig: int) -> None:
    """Signal a role, or the whole process group of a service (a command may start children of its own)."""
    assert child.proc is not None
    if child.role == "service":
        try:
            os.killpg(child.proc.pid, sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass
    else:
        child.proc.send_signal(sig)


def tail_log(path: Path, lines: int = 15) -> str:
    """The last lines of a child's log, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

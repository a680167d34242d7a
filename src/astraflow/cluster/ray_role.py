"""The body of every Ray actor of `launch ray`: it runs one `astraflow` role as its child process.

The actor runs the same command `astraflow up` and `launch slurm` run for that role (controller,
`join --role trainer` with torchrun under it for FSDP2, `join --role raas`), so keys, the run
directory and logs work as they do there. The child is started by a thread that lives exactly as long
as the child, with the kernel's parent-death signal set, so an actor killed by any means (kill -9 of
its process, `ray.kill`, its node lost) takes its role with it instead of leaving an orphan that still
holds leases under the member's name. This module does not import ray: `ray_launch` wraps the class
with `ray.remote`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_actor() -> None:
    """In the child, before exec: SIGKILL when the thread that started it (and so the actor) is gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class RoleProcess:
    """One role of a run, as a child process of this actor."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], run_dir: str, cwd: str = "") -> None:
        self.name = name
        self.argv = [sys.executable, "-m", "astraflow", *argv]
        self.env = {**os.environ, **env}
        self.run_dir = Path(run_dir)
        # the launch's directory, as `up`'s children inherit it (relative data paths of the recipe);
        # the run directory on a node that does not have it
        self.cwd = Path(cwd) if cwd and Path(cwd).is_dir() else self.run_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.rc: int | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._error = ""

    def start(self) -> dict[str, Any]:
        """Start the role; returns where it runs (node address, actor and role pids, Ray node, the
        resources and placement group Ray gave the actor), also written to RUN/launch/ray/<name>.json."""
        threading.Thread(target=self._own, name=f"role-{self.name}", daemon=True).start()
        self._started.wait()
        if self.proc is None:
            raise RuntimeError(f"cannot start {self.name}: {self._error}")
        info = {
            "name": self.name,
            "node": node_ip(),
            "actor_pid": os.getpid(),
            "pid": self.proc.pid,
            "started": time.time(),
            **ray_context(),
        }
        where = self.run_dir / "launch" / "ray"
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f"{self.name}.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(where / f"{self.name}.json")
        return info

    def _own(self) -> None:
        """Start the child and wait for it, in this thread only (the parent-death signal belongs to
        the thread that forked)."""
        logs = self.run_dir / "logs"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / f"{self.name}.log", "ab") as out:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                    preexec_fn=_die_with_actor,
                )
        except OSError as exc:
            self._error = str(exc)
            self.rc = 127
            self._started.set()
            self._done.set()
            return
        self._started.set()
        self.rc = self.proc.wait()
        self._done.set()

    def wait(self) -> int:
        """The role's exit code, once it has exited (negative: killed by that signal)."""
        self._done.wait()
        return int(self.rc if self.rc is not None else 1)

    def signal(self, signum: int) -> None:
        """Send the role a signal (SIGTERM: a worker drains, a trainer checkpoints and stops)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """Kill the role and whatever it started (torchrun's ranks: its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def address(self, timeout_s: float) -> str:
        """The controller's address as other nodes reach it: this node's IP and the port the
        controller bound (it writes RUN/controller.addr once it listens; the launch removed the old
        one), written back to RUN/controller.addr."""
        addr_file = self.run_dir / "controller.addr"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._done.is_set():
                raise RuntimeError(f"the controller exited with {self.rc} before it listened")
            if addr_file.is_file():
                text = addr_file.read_text().strip()
                if text:
                    # the reachable address, for `status`/`ctl`/`dash --run-dir` on any node
                    address = f"tcp://{node_ip()}:{text.rsplit(':', 1)[1]}"
                    tmp = addr_file.with_suffix(".tmp")
                    tmp.write_text(address + "\n")
                    tmp.replace(addr_file)
                    return address
            time.sleep(0.1)
        raise RuntimeError(f"the controller did not listen within {timeout_s:.0f}s")


def node_ip() -> str:
    """This node's address as the other nodes see it (Ray's own answer when ray is loaded)."""
    if "ray" in sys.modules:
        import ray

        return str(ray.util.get_node_ip_address())
    return socket.gethostbyname(socket.gethostname())


def ray_context() -> dict[str, Any]:
    """The Ray node id, assigned resources and placement group of this actor ({} outside Ray)."""
    if "ray" not in sys.modules:
        return {}
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "resources": {k: float(v) for k, v in ctx.get_assigned_resources().items()},
        "placement_group": ctx.get_placement_group_id() or "",
    }

"""The recipe's `[[service]]` processes under `astraflow up`: started before the roles, each in its own
process group, waited for until it accepts connections, and stopped (the whole group) after the roles.
The launcher's supervisor watches them like the roles: a service that exits before the run is over
ends the run, unless it has restarts left (`max_restarts`): then its process group is killed and its
command started again."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow import log
from astraflow.errors import AstraflowError

if TYPE_CHECKING:
    from astraflow.config.service import ServiceConfig
    from astraflow.launch.supervisor import Child, Supervisor

_log = log.get("launcher")
ROLE = "service"


def service_env(cfg: ServiceConfig, base: dict[str, str]) -> dict[str, str]:
    """The service's own variables, with the directory of astraflow's Python first on PATH (so that
    `python` in a command is the environment astraflow runs in)."""
    here = str(Path(sys.executable).parent)
    path = base.get("PATH", os.defpath)
    return {**cfg.env, "PATH": cfg.env.get("PATH", f"{here}{os.pathsep}{path}")}


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_ready(child: Child, cfg: ServiceConfig) -> None:
    """Block until the service accepts TCP connections on cfg.ready; fail if it exits or times out."""
    from astraflow.launch.supervisor import tail_log

    if not cfg.ready:
        return
    host, _, port = cfg.ready.rpartition(":")
    deadline = time.monotonic() + cfg.ready_timeout_s
    while not _accepts(host, int(port)):
        if not child.running:
            code = child.proc.returncode if child.proc is not None else None
            raise AstraflowError(
                f"service {cfg.name!r} exited (code {code}) before accepting connections on {cfg.ready}; "
                f"last lines of {child.log_path}:\n{tail_log(child.log_path)}",
                hint="check [[service]] command; run it by hand to see its error",
            )
        if time.monotonic() > deadline:
            raise AstraflowError(
                f"service {cfg.name!r} did not accept connections on {cfg.ready} within "
                f"{cfg.ready_timeout_s:g}s; last lines of {child.log_path}:\n{tail_log(child.log_path)}",
                hint="check that `ready` is the address it listens on, or raise ready_timeout_s",
            )
        time.sleep(0.05)
    _log.info("service %s ready on %s", cfg.name, cfg.ready)


def start_services(sup: Supervisor, services: list[ServiceConfig]) -> None:
    """Start every service in order, each waited for before the next (a later one may need an earlier one)."""
    import shutil

    for cfg in services:
        env = service_env(cfg, sup.env)
        if shutil.which(cfg.command[0], path=env["PATH"]) is None:
            raise AstraflowError(
                f"cannot start service-{cfg.name}: {cfg.command[0]!r} is not an executable here "
                "(nor on the service's PATH)",
                hint="check [[service]] command",
            )
        # the guard takes the service's whole process group down with it, even when `up` is SIGKILLed
        guarded = [sys.executable, "-m", "astraflow.launch.service_guard", "--", *cfg.command]
        child = sup.start_command(f"service-{cfg.name}", ROLE, guarded, env)
        wait_ready(child, cfg)

"""`astraflow leave MEMBER`: another name for `astraflow ctl drain MEMBER` (one code path, cli/ctl.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from astraflow.cli.ctl import ControllerKeyOpt, ControllerOpt, KeyOpt, RunDirOpt
from astraflow.transport.control_client import client_for


def leave(
    member: Annotated[str, typer.Argument(help="Member id of the RaaS to drain (see `astraflow status`).")],
    run_dir: RunDirOpt = None,
    controller: ControllerOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the controller.")] = 30.0,
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
) -> None:
    """Drain a worker (same as `astraflow ctl drain`): no new tasks; it finishes or returns its leases, then exits."""
    client = client_for(run_dir, controller, key, controller_key)
    client.timeout_s = timeout
    client.drain(member)
    typer.echo(f"{member} is draining: it finishes or returns its tasks, then leaves")

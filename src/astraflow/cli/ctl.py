"""`astraflow ctl pause|resume|drain|stop`: an operator's commands to a live controller.

Without authentication anyone who reaches the controller may send them (it then binds loopback only
unless started with --insecure); with a key store only an operator key may (observer keys read status).
`--run-dir` finds the address (RUN/controller.addr) and, for a run made by `up`, the operator key it made
(RUN/keys/members/operator.key_secret) by itself. The dashboard's control keys use the same client (transport/control_client.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from astraflow.transport.control_client import ControlClient, client_for

app = typer.Typer(
    help="Pause or resume admission, drain a worker, or stop a live run cleanly.", no_args_is_help=True
)


RunDirOpt = Annotated[
    Path | None, typer.Option("--run-dir", help="A live run's directory (finds address and `up`'s key).")
]
ControllerOpt = Annotated[
    str | None, typer.Option("--controller", help="Controller endpoint, e.g. tcp://HOST:7600.")
]
KeyOpt = Annotated[
    Path | None, typer.Option("--key", help="An operator key file (NAME.key_secret), with authentication.")
]
ControllerKeyOpt = Annotated[
    str | None, typer.Option("--controller-key", help="The controller's public key (file or Z85 text).")
]
PolicyOpt = Annotated[str, typer.Option("--policy", help="Only this policy (default: the whole run).")]


@app.command("pause")
def pause(
    run_dir: RunDirOpt = None,
    controller: ControllerOpt = None,
    policy: PolicyOpt = "",
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
) -> None:
    """Pause admission: no new prompts (for one policy or all); leased tasks finish, trainers keep training."""
    detail = client_for(run_dir, controller, key, controller_key).pause(policy)
    typer.echo(f"admission paused ({policy or 'whole run'}); {detail}")


@app.command("resume")
def resume(
    run_dir: RunDirOpt = None,
    controller: ControllerOpt = None,
    policy: PolicyOpt = "",
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
) -> None:
    """Resume admission (of one policy, or of everything paused)."""
    detail = client_for(run_dir, controller, key, controller_key).resume(policy)
    typer.echo(f"admission resumed ({policy or 'everything'}); {detail}")


@app.command("drain")
def drain(
    member: Annotated[str, typer.Argument(help="Member id of the RaaS (see `astraflow status`).")],
    run_dir: RunDirOpt = None,
    controller: ControllerOpt = None,
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
) -> None:
    """Drain a worker: no new tasks; it finishes or returns its leases, says Bye and exits."""
    client_for(run_dir, controller, key, controller_key).drain(member)
    typer.echo(f"{member} is draining: it finishes or returns its tasks, then leaves")


@app.command("stop")
def stop(
    run_dir: RunDirOpt = None,
    controller: ControllerOpt = None,
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
) -> None:
    """Stop the run cleanly: trainers finish the step they hold, checkpoint and exit; `up` exits 0."""
    client_for(run_dir, controller, key, controller_key).stop()
    typer.echo("stopping: trainers finish their step and checkpoint; workers leave")


__all__ = ["ControlClient", "app", "client_for"]

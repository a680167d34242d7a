"""`astraflow ctl pause|resume|drain|stop`: an operator's commands to a live controller.

Without authentication anyone who reaches the controller may send them (it then binds loopback only
unless started with --insecure); with a key store only an operator key may (observer keys read status).
`--run-dir` finds the address (RUN/controller.addr) and, for a run made by `up`, the operator key it made
(RUN/keys/members/operator.key_secret) by itself. The dashboard's control keys use the same client.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from astraflow.errors import AstraflowError, ConnectError

app = typer.Typer(
    help="Pause or resume admission, drain a worker, or stop a live run cleanly.", no_args_is_help=True
)


@dataclass
class ControlClient:
    """Sends Control and Leave requests to one controller, with an operator key when it authenticates."""

    address: str
    credentials: Any = None
    """security.MemberCredentials of an operator key, or None (authentication off)."""
    timeout_s: float = 10.0

    def send(self, msg: Any) -> str:
        """Send one request; returns the Ack's detail, raises AstraflowError on a refusal or no answer."""
        from astraflow.protocol.messages import Ack, Error
        from astraflow.transport.client import request_once

        reply = request_once(
            self.address,
            msg,
            ident=f"ctl-{socket.gethostname()}-{os.getpid()}"[:128],
            timeout_s=self.timeout_s,
            credentials=self.credentials,
        )
        if reply is None:
            raise ConnectError(
                f"controller at {self.address} did not answer within {self.timeout_s:g}s",
                hint="is the run still going? with authentication on, an unknown key gets no answer: "
                "pass an operator key (--key, --controller-key)",
            )
        if isinstance(reply, Error):
            raise AstraflowError(
                f"the controller refused: {reply.code}: {reply.message}",
                hint="an operator key is needed: astraflow keys new NAME, then on the controller host "
                "astraflow keys add NAME NAME.key --role operator"
                if reply.code == "not_authorized"
                else "`astraflow status` lists the run's policies and members",
            )
        if not isinstance(reply, Ack):
            raise AstraflowError(f"unexpected reply {type(reply).__name__}")
        return reply.detail

    def pause(self, policy: str = "") -> str:
        """Pause admission of one policy ("" = the whole run)."""
        from astraflow.protocol.messages import Control

        return self.send(Control(action="pause", policy=policy))

    def resume(self, policy: str = "") -> str:
        """Resume admission of one policy ("" = everything paused)."""
        from astraflow.protocol.messages import Control

        return self.send(Control(action="resume", policy=policy))

    def stop(self) -> str:
        """Stop the run cleanly: trainers checkpoint the step they hold and exit, `up` exits 0."""
        from astraflow.protocol.messages import Control

        return self.send(Control(action="stop"))

    def drain(self, member: str) -> str:
        """Drain a RaaS: no new tasks; it finishes or returns its leases and leaves."""
        from astraflow.protocol.messages import Leave

        return self.send(Leave(member_id=member))


def client_for(
    run_dir: Path | None, controller: str | None, key: Path | None, controller_key: str | None
) -> ControlClient:
    """The client for --run-dir (address and `up`'s operator key found there) or --controller ADDR."""
    if (run_dir is None) == (controller is None):
        raise AstraflowError(
            "give exactly one of --run-dir or --controller", hint="astraflow ctl pause --run-dir runs/<name>"
        )
    if run_dir is not None:
        addr_file = run_dir / "controller.addr"
        if not addr_file.is_file():
            raise AstraflowError(
                f"no live controller recorded in {run_dir} (no controller.addr)",
                hint="is the run going? `astraflow runs` lists run directories",
            )
        controller = addr_file.read_text().strip()
        keys = run_dir / "keys"
        if key is None and controller_key is None and (keys / "controller.key").is_file():
            key, controller_key = keys / "members" / "operator.key_secret", str(keys / "controller.key")
            if not key.is_file():
                raise AstraflowError(
                    f"the run authenticates but {key} is missing",
                    hint="pass an operator key: --key NAME.key_secret --controller-key "
                    f"{keys / 'controller.key'}",
                )
    return ControlClient(controller or "", _credentials(key, controller_key))


def _credentials(key: Path | None, controller_key: str | None) -> Any:
    """The operator's credentials, for this client only (not installed process-wide as a member's are)."""
    from astraflow.transport.keys import load_keypair, load_public
    from astraflow.transport.security import MemberCredentials

    if key is None and controller_key is None:
        return None
    if key is None or controller_key is None:
        raise AstraflowError(
            "--key and --controller-key go together", hint="pass the key file and the controller's key"
        )
    return MemberCredentials(keypair=load_keypair(key), controller_public=load_public(controller_key))


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

"""`astraflow leave MEMBER`: drain a rollout worker through the controller, then it exits by itself."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from astraflow.errors import AstraflowError, ConnectError


def leave(
    member: Annotated[str, typer.Argument(help="Member id of the RaaS to drain (see `astraflow status`).")],
    controller: Annotated[
        str, typer.Option("--controller", help="Controller endpoint, e.g. tcp://HOST:7600.")
    ],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the controller.")] = 30.0,
    key: Annotated[
        Path | None,
        typer.Option(
            "--key",
            help="An operator key file (NAME.key_secret; `up` makes RUN/keys/members/operator.key_secret) for an authenticated controller.",
        ),
    ] = None,
    controller_key: Annotated[
        str | None, typer.Option("--controller-key", help="The controller's public key (file or Z85 text).")
    ] = None,
) -> None:
    """Ask a RaaS to leave: it gets no new tasks, finishes (or returns) its leases, says Bye and exits."""
    from astraflow.cli.roles import member_credentials
    from astraflow.protocol.messages import Ack, Error, Leave
    from astraflow.transport.client import request_once

    reply = request_once(
        controller,
        Leave(rid=1, member_id=member),
        ident=f"leave-{socket.gethostname()}-{os.getpid()}"[:128],
        timeout_s=timeout,
        credentials=member_credentials(key, controller_key),
    )
    if reply is None:
        raise ConnectError(
            f"controller at {controller} did not answer within {timeout:.0f}s",
            hint="is `astraflow controller` running there? with authentication on, pass --key (an operator "
            "key) and --controller-key (an unknown key gets no answer at all)",
        )
    if isinstance(reply, Error):
        raise AstraflowError(
            f"the controller refused: {reply.code}: {reply.message}",
            hint="`astraflow status --controller ADDR` lists the live members",
        )
    if not isinstance(reply, Ack):
        raise AstraflowError(f"unexpected reply {type(reply).__name__}")
    typer.echo(f"{member} is draining: it finishes or returns its tasks, then leaves")

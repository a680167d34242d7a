"""`astraflow leave MEMBER`: drain a rollout worker through the controller, then it exits by itself."""

from __future__ import annotations

import os
import socket
from typing import Annotated

import typer

from astraflow.errors import AstraflowError


def leave(
    member: Annotated[str, typer.Argument(help="Member id of the RaaS to drain (see `astraflow status`).")],
    controller: Annotated[
        str, typer.Option("--controller", help="Controller endpoint, e.g. tcp://HOST:7600.")
    ],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the controller.")] = 30.0,
) -> None:
    """Ask a RaaS to leave: it gets no new tasks, finishes (or returns) its leases, says Bye and exits."""
    from astraflow.protocol.messages import PROTOCOL_VERSION, Ack, Error, Hello, Leave
    from astraflow.transport.client import MemberClient

    hello = Hello(
        member_id=f"leave-{socket.gethostname()}-{os.getpid()}"[:255],
        role="observer",
        protocol=PROTOCOL_VERSION,
        pid=os.getpid(),
        host=socket.gethostname(),
    )
    client = MemberClient(controller, hello, connect_timeout_s=timeout)
    try:
        client.connect()
        reply = client.request(Leave(member_id=member), timeout_s=timeout)
    finally:
        client.close("leave sent")
    if isinstance(reply, Error):
        raise AstraflowError(
            f"the controller refused: {reply.code}: {reply.message}",
            hint="`astraflow status --controller ADDR` lists the live members",
        )
    if not isinstance(reply, Ack):
        raise AstraflowError(f"unexpected reply {type(reply).__name__}")
    typer.echo(f"{member} is draining: it finishes or returns its tasks, then leaves")

"""What RaaS and trainer processes share: their Hello and how they describe their hardware."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astraflow.protocol.messages import PROTOCOL_VERSION, Hello, Welcome

if TYPE_CHECKING:
    from astraflow.transport.client import MemberClient


def hardware() -> str:
    """A short description of this machine's compute, e.g. 'cpu:2' or 'cuda:NVIDIA H100 x1'."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"cpu:{os.cpu_count() or 1}"


def make_hello(
    role: str, member_id: str | None, *, policies: list[str], region: str = "", slots: int = 0
) -> Hello:
    """The Hello this process sends; the default id is role-host-pid (unique, stable for the process)."""
    host = socket.gethostname()
    return Hello(
        member_id=member_id or f"{role}-{host}-{os.getpid()}",
        role=role,
        protocol=PROTOCOL_VERSION,
        policies=policies,
        region=region,
        hardware=hardware(),
        slots=slots,
        pid=os.getpid(),
        host=host or platform.node(),
    )


def advertise_host(controller: str) -> str:
    """The local address peers reach us on: the interface used to reach the controller."""
    host = controller.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def request_retrying(
    client: MemberClient,
    msg: Any,
    *,
    timeout_s: float = 30.0,
    give_up_after_s: float = 600.0,
    stop: Callable[[], bool] | None = None,
) -> Any:
    """A request that survives a controller restart: on ConnectError, wait and ask again (the client
    re-sends its Hello by itself once the controller is back), until give_up_after_s (each attempt
    waits at most what is left of it). With `stop`, the waits for a reply and between attempts end in
    errors.Stopped once it is true."""
    import time

    from astraflow import log
    from astraflow.errors import ConnectError, Stopped

    deadline = time.monotonic() + give_up_after_s
    warned = False
    while True:
        try:
            # no attempt outlives the deadline: a caller that gives up after 3 s waits 3 s, not 30;
            # `stop` only when given: a client without it (a test's fake) keeps working
            left = min(timeout_s, max(0.5, deadline - time.monotonic()))
            reply = client.request(msg, timeout_s=left, **({"stop": stop} if stop is not None else {}))
            if warned:
                log.get("member").info("controller answers again")
            return reply
        except ConnectError:
            if time.monotonic() > deadline:
                raise
            client.check_reachable()  # a revoked key or a wrong address: waiting will not help
            if not warned:
                log.get("member").warning("controller not answering; retrying until it is back")
                warned = True
            client.tick()
            for _ in range(10):
                if stop is not None and stop():
                    raise Stopped(
                        f"stopped while the controller did not answer {type(msg).__name__}"
                    ) from None
                time.sleep(0.1)


RETRY_JOIN_CODES = ("member_id_in_use", "trainer_taken")
"""Refusals that end by themselves: the previous process under this id (or the policy's previous
trainer) falls silent and the controller declares it dead after controller.member_timeout_s."""


def connect_retrying(client: MemberClient, give_up_after_s: float = 120.0) -> Welcome:
    """client.connect(), asking again while the controller still sees this id's previous process alive."""
    import time

    from astraflow import log
    from astraflow.errors import ProtocolError
    from astraflow.roles import member_files

    deadline = time.monotonic() + give_up_after_s
    while True:
        try:
            welcome = client.connect()
            logged = member_files.open_log(client.hello.member_id, welcome.run_name)
            log.get("member").info(
                "joined run %s at %s as %s (%s)%s",
                welcome.run_name,
                client.controller,
                client.hello.member_id,
                client.hello.role,
                f"; log {logged}" if logged is not None else "",
            )
            return welcome
        except ProtocolError as exc:
            if not any(f": {code}:" in exc.message for code in RETRY_JOIN_CODES):
                raise
            if time.monotonic() > deadline:
                raise
            log.get("member").warning("%s; asking again", exc.message)
            time.sleep(1.0)

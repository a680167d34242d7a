"""One-shot requests to a live controller, for people and their tools: status, pause, resume, stop and
drain. `astraflow ctl`, `leave`, `status`, `dash`, the dashboard and `doctor` all use this client; each
request is idempotent and sent by `request_once` (no Hello, no heartbeats)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError, ConnectError

if TYPE_CHECKING:
    from astraflow.protocol.messages import Msg
    from astraflow.transport.security import MemberCredentials


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
    return ControlClient(controller or "", operator_credentials(key, controller_key))


def operator_credentials(key: Path | None, controller_key: str | None) -> Any:
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


def ask_status(controller: str, timeout_s: float = 5.0, credentials: Any = None) -> dict[str, Any]:
    """The status document asked of a live controller over the control plane.

    With credentials (security.MemberCredentials) the request goes over CURVE under the key's name.
    """
    import os

    from astraflow.protocol.messages import Error, StatusReply, StatusRequest

    reply = request_once(
        controller,
        StatusRequest(rid=1),
        ident=f"status-{os.getpid()}",
        timeout_s=timeout_s,
        credentials=credentials,
    )
    if reply is None:
        raise ConnectError(
            f"controller at {controller} did not answer within {timeout_s:.0f}s",
            hint="is `astraflow controller` running there? with authentication on, pass --key and "
            "--controller-key (an unknown key gets no answer at all)",
        )
    if isinstance(reply, Error):
        raise ConnectError(
            f"controller at {controller} refused the status request: {reply.code}: {reply.message}",
            hint="pass --key (an observer key added with `astraflow keys add`) and --controller-key",
        )
    if not isinstance(reply, StatusReply):
        raise ConnectError(f"controller at {controller} answered {type(reply).__name__}, not a status")
    return reply.status


def request_once(
    controller: str, msg: Msg, *, ident: str, timeout_s: float, credentials: MemberCredentials | None = None
) -> Msg | None:
    """Send one request that needs no Hello (status, leave) and return the reply, or None on timeout.

    With credentials the request goes over CURVE under the key's name (the controller knows the sender
    only by its key); an unknown key gets no answer at all, which reads as a timeout here.

    Without an answer the request is sent again on a fresh connection after 0.5 s, 1 s, 2 s, ... (up
    to 5 s apart): the controller's ROUTER ignores a connection whose identity a previous connection
    still holds until it has seen that one close (two `ctl` calls in a row under one key's name), and
    it never delivers from the ignored one. Only idempotent requests may use this (status, pause,
    resume, stop, leave); the first answer wins. When the first attempt goes unanswered, a probe
    (transport/probe.py) raises the cause it finds (nothing listening, a refused key, a bad address).
    """
    import time

    import zmq

    from astraflow.protocol.codec import decode, encode
    from astraflow.transport.probe import parse_endpoint
    from astraflow.transport.security import curve_client, routing_id

    parse_endpoint(controller)  # a bad address is one line with a hint, not zmq's "Invalid argument"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    if credentials is not None:
        ident = credentials.keypair.name or ident
    payload = encode(msg)
    deadline = time.monotonic() + timeout_s
    wait_s = 0.5
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if credentials is not None:
            curve_client(sock, credentials.keypair, credentials.controller_public)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(ident, credentials))
        try:
            sock.connect(controller)
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection to queue to yet: the next attempt sends again
            left = deadline - time.monotonic()
            if left > 0 and sock.poll(int(min(left, wait_s) * 1000)):
                return decode(sock.recv())
        finally:
            sock.close()
        if time.monotonic() >= deadline:
            return None
        if wait_s == 0.5:  # the first attempt went unanswered: a refused key or a bad address says why now
            from astraflow.transport.probe import probe

            err = probe(controller, credentials, timeout_s=min(3.0, max(0.5, deadline - time.monotonic())))
            if err is not None:
                raise err
        wait_s = min(wait_s * 2, 5.0)

"""Why a controller does not answer: a quick probe that names the cause an operator can act on.

A silent controller looks the same from a member's DEALER whatever the cause (zmq redials quietly), so
when an answer is late the member asks this module: is the address well formed, does the host name
resolve, does a TCP connect succeed (refused: nothing listens on the port; no answer: the host or a
firewall drops it), and how does a CURVE handshake on a fresh socket end (read from the socket's
monitor events: the ZAP handler refuses an unknown key with status 400 and a revoked one with
security.REVOKED_STATUS; a wrong controller key or a mechanism mismatch fails the handshake itself).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from astraflow.errors import ConnectError
from astraflow.transport.security import REVOKED_STATUS, MemberCredentials, curve_client


class ControllerUnreachable(ConnectError):
    """The probe found a cause that waiting will not fix: bad address, refused key, wrong controller key."""


class ControllerAbsent(ConnectError):
    """Nothing answers at the address (refused port, silent host): fixed by starting the controller there."""


def parse_endpoint(endpoint: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a tcp endpoint; ControllerUnreachable for one that is not tcp://HOST:PORT."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise ControllerUnreachable(
            f"controller address {endpoint!r} has no scheme",
            hint=f"write it as tcp://HOST:PORT, e.g. tcp://{endpoint}",
        )
    if scheme != "tcp":
        return scheme, rest, 0
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ControllerUnreachable(
            f"controller address {endpoint!r} is not tcp://HOST:PORT", hint="e.g. tcp://10.0.0.5:7600"
        )
    return scheme, host.strip("[]"), int(port)


def probe(
    endpoint: str, credentials: MemberCredentials | None, timeout_s: float = 3.0
) -> ConnectError | None:
    """The reason endpoint does not answer this member, or None when a handshake succeeds (it is busy)."""
    try:
        scheme, host, port = parse_endpoint(endpoint)
    except ControllerUnreachable as exc:
        return exc
    if scheme == "tcp":
        err = _tcp_check(endpoint, host, port, timeout_s)
        if err is not None:
            return err
    return _handshake_check(endpoint, credentials, timeout_s)


def _tcp_check(endpoint: str, host: str, port: int, timeout_s: float) -> ConnectError | None:
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return ControllerUnreachable(
            f"controller host {host!r} does not resolve ({exc.strerror})",
            hint=f"check the host name in {endpoint} (or use its IP address)",
        )
    family, kind, proto, _, addr = addrs[0]
    with socket.socket(family, kind, proto) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(addr)
        except ConnectionRefusedError:
            return ControllerAbsent(
                f"nothing listens at {endpoint} (connection refused)",
                hint="is `astraflow controller` running on that host, and is this its --bind port? "
                "(it logs `controller listening on ...`; a run that ended has no controller any more)",
            )
        except TimeoutError:
            return ControllerAbsent(
                f"host {host} did not answer on port {port} within {timeout_s:g}s",
                hint="the host is down or a firewall drops the port; check the address",
            )
        except OSError as exc:
            return ControllerAbsent(
                f"cannot reach {host}:{port}: {exc.strerror or exc}",
                hint="check the address and the network route to that host",
            )
    return None


_MECHANISM_MISMATCH = 0x11000002
"""libzmq's ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: one side speaks CURVE, the other NULL."""
_MISMATCH_HINT = (
    "the controller runs with keys: pass --key NAME.key_secret and --controller-key controller.key "
    "(docs/operations.md, Authentication), or it runs without keys and this member passed them"
)


def _handshake_check(
    endpoint: str, credentials: MemberCredentials | None, timeout_s: float
) -> ConnectError | None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        if credentials is not None:
            curve_client(sock, credentials.keypair, credentials.controller_public)
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        verdict: ConnectError | None = None
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000)):
                break
            event = parse_monitor_message(monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return None
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return _auth_error(endpoint, credentials, value)
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
                return ControllerUnreachable(
                    f"the controller at {endpoint} "
                    + (
                        "requires a key and this member passed none"
                        if credentials is None
                        else "runs without keys"
                    ),
                    hint=_MISMATCH_HINT,
                )
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return _protocol_error(endpoint, credentials)
            # no detail (the peer closed): a more precise event may follow it on the next attempt
            verdict = _protocol_error(endpoint, credentials)
            deadline = min(deadline, time.monotonic() + 0.5)
        return verdict  # None: no verdict in time, left to the caller's own timeout
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def _auth_error(endpoint: str, credentials: MemberCredentials | None, status: int) -> ConnectError:
    name = credentials.keypair.name if credentials is not None else ""
    if status == REVOKED_STATUS:
        return ControllerUnreachable(
            f"the controller at {endpoint} refused key {name!r}: it is revoked",
            hint="make a new key (astraflow keys new NAME) and add it on the controller host "
            "(astraflow keys add NAME NAME.key --role ROLE)",
        )
    return ControllerUnreachable(
        f"the controller at {endpoint} does not know key {name!r}",
        hint=f"on the controller host: astraflow keys add {name or 'NAME'} {name or 'NAME'}.key --role ROLE "
        "(astraflow keys list shows the registered keys); or this is another run's controller",
    )


def _protocol_error(endpoint: str, credentials: MemberCredentials | None) -> ConnectError:
    if credentials is None:
        return ControllerUnreachable(
            f"the handshake with {endpoint} failed: the controller requires a key and this member passed "
            "none (or this is not an astraflow controller)",
            hint=_MISMATCH_HINT,
        )
    return ControllerUnreachable(
        f"the CURVE handshake with {endpoint} failed: --controller-key is not that controller's key "
        "(or it runs without keys)",
        hint="pass the controller.key file from the controller's key store (astraflow keys init wrote it)",
    )

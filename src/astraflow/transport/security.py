"""CURVE on our sockets: a server side with a ZAP handler (pyzmq's zmq.auth) and a client side.

A server is a CURVE server with a key pair; pyzmq's ThreadAuthenticator answers the ZAP requests of
its context, asking `allow(public_key)` for every new connection (so a key store's current state
decides, revocations included). The socket enforces the ZAP domain, so without a running handler no
connection is accepted at all. Each received frame carries its sender's public key as the ZAP
User-Id, which the controller's transport maps to a Principal per frame.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from astraflow.transport.keys import KeyPair, KeyStore

ZAP_DOMAIN = "astraflow"
"""The ZAP domain our CURVE servers use."""


@dataclass(frozen=True)
class MemberCredentials:
    """What a member process authenticates with: its key pair and the controller's public key."""

    keypair: KeyPair
    controller_public: bytes


_credentials: MemberCredentials | None = None
_server_keys: KeyStore | None = None


def set_member_credentials(creds: MemberCredentials | None) -> None:
    """Set this process's member credentials (the CLI does, from --key and --controller-key)."""
    global _credentials
    _credentials = creds


def member_credentials() -> MemberCredentials | None:
    """This process's member credentials, or None when it runs without authentication."""
    return _credentials


def set_server_keys(keys: KeyStore | None) -> None:
    """Set the key store this process's controller transport authenticates with (the CLI does)."""
    global _server_keys
    _server_keys = keys


def server_keys() -> KeyStore | None:
    """The key store set for this process's controller transport, or None (authentication off)."""
    return _server_keys


def routing_id(member_id: str, credentials: MemberCredentials | None) -> bytes:
    """The routing id a member dials with: its id without keys; with keys a random one (the server
    names senders by key), so that no other key can claim the id first and keep the member out."""
    if credentials is None:
        return member_id.encode()
    return f"{member_id[:100]}.{os.urandom(8).hex()}".encode()


def curve_client(sock: zmq.Socket, keypair: KeyPair, server_public: bytes) -> None:
    """Make sock a CURVE client of the server with that public key (before connect)."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


REVOKED_STATUS = 500
"""The ZAP status a revoked key's handshake is refused with (400 for an unknown key; 300 would drop the
connection without telling the client). libzmq passes
only the status code (200/300/400/500) to the client, which sees it as the value of its
EVENT_HANDSHAKE_FAILED_AUTH event: that is how a member tells "revoked" from "unknown"."""


class _Provider:
    """The ZAP callback object pyzmq's authenticator asks about each new connection."""

    def __init__(self, allow: Callable[[bytes], bool], revoked: Callable[[bytes], bool] | None) -> None:
        self.allow = allow
        self.revoked = revoked
        self.last_revoked = False
        """Whether the key refused last was a revoked one (read by _Authenticator's reply)."""

    def callback(self, domain: str, key: bytes) -> bool:
        self.last_revoked = False
        try:
            ok = bool(self.allow(key))
            if not ok and self.revoked is not None:
                self.last_revoked = bool(self.revoked(key))
            return ok
        except Exception:  # a failing check admits nobody
            return False


class _Authenticator(ThreadAuthenticator):
    """pyzmq's authenticator, answering a revoked key with REVOKED_STATUS instead of 400."""

    provider: _Provider | None = None

    def _send_zap_reply(
        self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = "anonymous"
    ) -> None:
        if status_code == b"400" and self.provider is not None and self.provider.last_revoked:
            status_code, status_text = str(REVOKED_STATUS).encode(), b"key revoked"
            self.provider.last_revoked = False
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


def curve_server(
    ctx: zmq.Context, sock: zmq.Socket, keypair: KeyPair, allow: Callable[[bytes], bool] | None
) -> ThreadAuthenticator:
    """Make sock a CURVE server (before bind) whose ZAP handler admits keys `allow` accepts (None: any).

    Returns the running authenticator; stop() it before terminating the context.
    """
    auth = _Authenticator(ctx)
    auth.start()
    if allow is None:
        auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
    else:
        # a key store's admits() comes with its revoked(): a revoked key gets its own refusal
        store = getattr(allow, "__self__", None)
        auth.provider = _Provider(allow, store.revoked if isinstance(store, KeyStore) else None)
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=auth.provider)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    # with no ZAP handler answering, refuse connections instead of admitting them
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return auth

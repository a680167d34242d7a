"""CURVE key files and the controller's key store: which public key is which member, in which role.

Key files are ZeroMQ certificates written and read by pyzmq's `zmq.auth` (NAME.key holds the public
key, NAME.key_secret both keys). A key store is a directory holding the controller's key pair
(controller.key, controller.key_secret) and members.json, the registry of member public keys with
their name, role, optional policy and revoked flag. `astraflow keys ...` edits members.json by atomic
replace; a running controller re-reads it when it changes, so a revocation needs no restart.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from astraflow.errors import AstraflowError
from astraflow.transport.principal import Principal

CONTROLLER = "controller"
"""Base name of the controller's key pair inside a key store."""
MEMBERS_FILE = "members.json"
"""The registry of member keys inside a key store."""
ROLES = ("raas", "trainer", "observer", "operator")
"""Roles a member key can be added with."""
PULL_ROLES = ("raas", "trainer")
"""Roles whose keys may pull weights from a weight server."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_Z85_LEN = 40


class KeyStoreError(AstraflowError):
    """A key file or key store that is missing, malformed or would become inconsistent."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as Z85 text (bytes), and the member name its file carries, if any."""

    public: bytes
    secret: bytes
    name: str = ""


def check_name(name: str) -> str:
    """A member name usable as a socket routing id: 1-128 of letters, digits, '.', '_', '-'."""
    if not _NAME.match(name):
        raise KeyStoreError(
            f"bad member name {name!r}",
            hint="use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return name


def new_key_files(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (both keys, mode 0600) into directory."""
    check_name(name)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise KeyStoreError(
            f"{secret} already exists", hint="pick another name or directory; keys are never overwritten"
        )
    # created empty with 0600 first, so the secret is never readable by others, even briefly
    secret.touch(mode=0o600)
    zmq.auth.create_certificates(str(directory), name, metadata={"name": name})
    os.chmod(secret, 0o600)
    return public, secret


def load_keypair(path: Path) -> KeyPair:
    """The key pair in a NAME.key_secret file (KeyStoreError if it is missing or holds no secret key)."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeyStoreError(
            f"cannot read key file {path}: {exc}", hint="create one: astraflow keys new NAME --dir DIR"
        ) from None
    if not secret:
        raise KeyStoreError(f"{path} holds no secret key", hint="pass the NAME.key_secret file, not NAME.key")
    _check_z85(public, str(path))
    _check_z85(secret, str(path))
    name = ""
    for line in path.read_text(errors="replace").splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.strip() == "name":
            name = value.strip().strip("\"'")
            break
    return KeyPair(public=public, secret=secret, name=name)


def load_public(spec: str) -> bytes:
    """A public key given as a key file path or as 40 characters of Z85 text."""
    path = Path(spec)
    if path.is_file():
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except ValueError as exc:
            raise KeyStoreError(f"cannot read key file {path}: {exc}", hint="pass a NAME.key file") from None
        return _check_z85(public, spec)
    return _check_z85(spec.encode(), "the key given")


def _check_z85(key: bytes, where: str) -> bytes:
    try:
        ok = len(key) == _Z85_LEN and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise KeyStoreError(
            f"{where}: not a CURVE key (a file path that does not exist, or not 40 characters of Z85)",
            hint="pass the NAME.key file, or the public key printed by `astraflow keys new`",
        )
    return key


class KeyStore:
    """A key store directory: the controller's key pair and the member registry, re-read when it changes."""

    def __init__(self, directory: Path) -> None:
        """Open an existing key store (KeyStoreError if `astraflow keys init` was not run on it)."""
        self.directory = Path(directory)
        if not (self.directory / f"{CONTROLLER}.key_secret").is_file():
            raise KeyStoreError(
                f"no key store in {self.directory}",
                hint=f"create one: astraflow keys init --keys {self.directory}",
            )
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._by_key: dict[bytes, Principal] = {}
        self.refresh(force=True)

    @staticmethod
    def exists(directory: Path) -> bool:
        """Whether directory holds a key store."""
        return (Path(directory) / f"{CONTROLLER}.key_secret").is_file()

    @classmethod
    def init(cls, directory: Path) -> KeyStore:
        """Create a key store: the controller's key pair and an empty member registry."""
        directory = Path(directory)
        if cls.exists(directory):
            raise KeyStoreError(
                f"{directory} already holds a key store", hint="use it, or pick another --keys DIR"
            )
        directory.mkdir(parents=True, exist_ok=True)
        # only its owner may list or swap the registry, whatever the umask
        os.chmod(directory, 0o700)
        new_key_files(directory, CONTROLLER)
        _write_members(directory, {})
        return cls(directory)

    def controller_keypair(self) -> KeyPair:
        """The controller's key pair."""
        return load_keypair(self.directory / f"{CONTROLLER}.key_secret")

    def members(self) -> dict[str, dict[str, Any]]:
        """Name -> {public_key, role, policy, revoked, added} as stored."""
        return _read_members(self.directory)

    def add(self, name: str, public: bytes, role: str, policy: str | None = None) -> None:
        """Register a member key; a name or key already in use (and not revoked) is refused."""
        check_name(name)
        if role not in ROLES:
            raise KeyStoreError(f"unknown role {role!r}", hint="--role raas, trainer, observer or operator")
        _check_z85(public, "the public key")
        if public == self.controller_keypair().public:
            raise KeyStoreError("that is the controller's own key", hint="give the member's public key")
        members = self.members()
        old = members.get(name)
        if old is not None and not old.get("revoked"):
            raise KeyStoreError(
                f"member {name!r} already has a key", hint=f"revoke it first: astraflow keys revoke {name}"
            )
        for other, row in members.items():
            if row["public_key"] == public.decode() and not row.get("revoked"):
                raise KeyStoreError(
                    f"that key is already registered as {other!r}", hint="each member needs its own key"
                )
        members[name] = {
            "public_key": public.decode(),
            "role": role,
            "policy": policy,
            "revoked": False,
            "added": time.time(),
        }
        _write_members(self.directory, members)
        self.refresh(force=True)

    def revoke(self, name: str) -> None:
        """Mark a member's key revoked: a live controller refuses its frames from its next poll on."""
        members = self.members()
        if name not in members:
            raise KeyStoreError(
                f"no member {name!r} in {self.directory}", hint="astraflow keys list --keys DIR"
            )
        members[name]["revoked"] = True
        members[name]["revoked_at"] = time.time()
        _write_members(self.directory, members)
        self.refresh(force=True)

    def refresh(self, *, force: bool = False, every_s: float = 0.1) -> None:
        """Re-read members.json if it changed (checked at most every `every_s` unless forced).

        The ZAP thread and the socket's own thread both refresh: one refresh runs at a time, so an
        older read can never overwrite a newer one (a key the handshake admitted, then unknown to
        the frame check)."""
        with self._refresh_lock:
            self._refresh(force, every_s)

    def _refresh(self, force: bool, every_s: float) -> None:
        now = time.monotonic()
        if not force and now - self._checked < every_s:
            return
        self._checked = now
        path = self.directory / MEMBERS_FILE
        try:
            st = path.stat()
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            seen = (0, 0, 0)
        if not force and seen == self._seen:
            return
        try:
            members = _read_members(self.directory)
            by_key = {
                row["public_key"].encode(): Principal(name=name, role=row["role"], policy=row.get("policy"))
                for name, row in members.items()
                if not row.get("revoked")
            }
        except Exception:  # an unreadable or hand-broken registry admits nobody rather than everybody
            by_key = {}
        with self._lock:
            self._by_key = by_key
            self._seen = seen

    def admits(self, public_z85: bytes) -> bool:
        """Whether a key may connect now (the ZAP check: re-reads the registry if it changed)."""
        self.refresh()
        if self.principal(public_z85) is None:
            self.refresh(every_s=0.0)  # a key added a moment ago, inside the throttle window: look again
        return self.principal(public_z85) is not None

    def admits_puller(self, public_z85: bytes) -> bool:
        """Whether a key may pull weights now: a raas or trainer key (observers and operators may not)."""
        if not self.admits(public_z85):
            return False
        who = self.principal(public_z85)
        return who is not None and who.role in PULL_ROLES

    def principal(self, public_z85: bytes) -> Principal | None:
        """The member a (non-revoked) public key belongs to, or None."""
        return self._by_key.get(public_z85)

    def revoked(self, public_z85: bytes) -> bool:
        """Whether this public key was registered and is revoked (not merely unknown)."""
        try:
            members = _read_members(self.directory)
        except Exception:
            return False
        key = public_z85.decode()
        rows = [row for row in members.values() if row.get("public_key") == key]
        return bool(rows) and all(row.get("revoked") for row in rows)


def write_member_keys(store: KeyStore, directory: Path, members: list[tuple[str, str, str | None]]) -> None:
    """Make a key pair file for each (name, role, policy) in `directory` and register them all in one
    write of the store's registry (a bench registers thousands; `KeyStore.add` rewrites it per key)."""
    registry = store.members()
    for name, role, _policy in members:
        check_name(name)
        if role not in ROLES:
            raise KeyStoreError(f"unknown role {role!r}", hint="raas, trainer, observer or operator")
        if name in registry and not registry[name].get("revoked"):
            raise KeyStoreError(f"member {name!r} already has a key", hint="pick new names")
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for name, role, policy in members:
        public, secret = zmq.curve_keypair()
        path = directory / f"{name}.key_secret"
        path.touch(mode=0o600)
        path.write_text(
            f'metadata\n    name = "{name}"\ncurve\n    public-key = "{public.decode()}"\n'
            f'    secret-key = "{secret.decode()}"\n'
        )
        registry[name] = {
            "public_key": public.decode(),
            "role": role,
            "policy": policy,
            "revoked": False,
            "added": now,
        }
    _write_members(store.directory, registry)
    store.refresh(force=True)


def _read_members(directory: Path) -> dict[str, dict[str, Any]]:
    path = directory / MEMBERS_FILE
    try:
        doc = json.loads(path.read_text())
        members = doc["members"]
        assert isinstance(members, dict)
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        raise KeyStoreError(
            f"cannot read {path}: {exc}", hint="restore it from a backup, or run keys init on a new dir"
        ) from None
    return members


def _write_members(directory: Path, members: dict[str, dict[str, Any]]) -> None:
    path = directory / MEMBERS_FILE
    tmp = directory / f".{MEMBERS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"version": 1, "members": members}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # atomic: a controller reading it sees the old or the new registry, never half

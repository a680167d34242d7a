"""Each way a member can fail to reach its controller gets its own message, within seconds, exit != 0:
a real controller process with a key store and real `astraflow join` / `astraflow status` commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow.bench.wire import start_controller
from astraflow.transport.keys import KeyStore, load_keypair, new_key_files
from tests.ports import free_port

CONNECT_TIMEOUT = "60"
"""--connect-timeout of each join: an error must come from the probe, long before this."""


class Keyed:
    """A controller with a key store: raas-1 registered, raas-2 revoked, stranger never added."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        store = KeyStore.init(tmp / "keys")
        self.secret: dict[str, Path] = {}
        for name in ("raas-1", "raas-2", "stranger", "other"):
            _, secret = new_key_files(tmp / "member-keys", name)
            self.secret[name] = secret
            if name in ("raas-1", "raas-2"):
                store.add(name, load_keypair(secret).public, "raas")
        store.revoke("raas-2")
        KeyStore.init(tmp / "other-keys")  # another controller's key
        self.proc, self.addr = start_controller(tmp / "ctl", keys=tmp / "keys")

    def join(
        self, *args: str, controller: str | None = None
    ) -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "astraflow",
                "join",
                "--role",
                "raas",
                "--controller",
                controller or self.addr,
            ]
            + ["--connect-timeout", CONNECT_TIMEOUT, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return out, time.monotonic() - t0

    def key_args(self, name: str, controller_key: Path | None = None) -> list[str]:
        ck = controller_key or self.tmp / "keys" / "controller.key"
        return ["--key", str(self.secret[name]), "--controller-key", str(ck)]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    k = Keyed(tmp_path_factory.mktemp("keyed"))
    try:
        yield k
    finally:
        k.proc.kill()
        k.proc.wait()


def _assert_error(out: subprocess.CompletedProcess[str], took: float, needle: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert needle in out.stderr, out.stderr
    assert "hint:" in out.stderr
    # far below --connect-timeout: the probe answered, not the timeout
    assert took < float(CONNECT_TIMEOUT) / 2, took


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("unknown", "does not know key 'stranger'"),
        ("revoked", "refused key 'raas-2': it is revoked"),
        ("wrong_controller_key", "--controller-key is not that controller's key"),
        ("missing_key", "requires a key and this member passed none"),
        ("closed_port", "nothing listens at"),
        ("bad_host", "does not resolve"),
        ("no_scheme", "has no scheme"),
    ],
)
def test_each_connect_failure_has_its_own_message(keyed: Keyed, case: str, needle: str) -> None:
    host_port = keyed.addr.removeprefix("tcp://")
    args, controller = {
        "unknown": (keyed.key_args("stranger"), None),
        "revoked": (keyed.key_args("raas-2"), None),
        "wrong_controller_key": (keyed.key_args("raas-1", keyed.tmp / "other-keys" / "controller.key"), None),
        "missing_key": ([], None),
        "closed_port": (keyed.key_args("raas-1"), f"tcp://127.0.0.1:{free_port()}"),
        "bad_host": (keyed.key_args("raas-1"), "tcp://no-such-host.invalid:7600"),
        "no_scheme": (keyed.key_args("raas-1"), host_port),
    }[case]
    out, took = keyed.join(*args, controller=controller)
    _assert_error(out, took, needle)


def test_status_with_a_revoked_key_says_so(keyed: Keyed) -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", "status", "--controller", keyed.addr, *keyed.key_args("raas-2")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_error(out, time.monotonic() - t0, "it is revoked")


def test_a_member_revoked_while_joined_stops_with_the_reason(keyed: Keyed) -> None:
    from astraflow.protocol.messages import PROTOCOL_VERSION, Hello, StatusRequest
    from astraflow.roles.member import request_retrying
    from astraflow.transport.client import MemberClient
    from astraflow.transport.probe import ControllerUnreachable
    from astraflow.transport.security import MemberCredentials

    _, secret = new_key_files(keyed.tmp / "member-keys", "raas-5")
    pair = load_keypair(secret)
    KeyStore(keyed.tmp / "keys").add("raas-5", pair.public, "raas")
    controller_public = KeyStore(keyed.tmp / "keys").controller_keypair().public
    hello = Hello(member_id="raas-5", role="raas", protocol=PROTOCOL_VERSION, policies=["main"], slots=1)
    client = MemberClient(
        keyed.addr, hello, connect_timeout_s=30, credentials=MemberCredentials(pair, controller_public)
    )
    try:
        client.connect()
        KeyStore(keyed.tmp / "keys").revoke("raas-5")
        # its frames are dropped from now on: the next unanswered request probes and names the cause
        deadline = time.monotonic() + 60
        with pytest.raises(ControllerUnreachable, match="it is revoked"):
            while time.monotonic() < deadline:  # answered until the controller has re-read its registry
                request_retrying(client, StatusRequest(), timeout_s=2.0, give_up_after_s=120.0)
    finally:
        client.close()

"""CURVE authentication against a real controller process: unknown and revoked keys deliver nothing,
a key acts only under its own member id and role, a live member's id cannot be taken over."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from astraflow.bench.wire import start_controller
from astraflow.cli.status import read_status
from astraflow.errors import ConnectError
from astraflow.protocol.codec import decode, encode
from astraflow.protocol.messages import (
    PROTOCOL_VERSION,
    Error,
    Heartbeat,
    Hello,
    Msg,
    StatusReply,
    StatusRequest,
    TaskGrant,
    TaskRequest,
    WeightRequest,
    Welcome,
)
from astraflow.transport.client import MemberClient
from astraflow.transport.keys import KeyPair, KeyStore, load_keypair, new_key_files
from astraflow.transport.security import MemberCredentials, curve_client
from astraflow.weights.client import fetch_weights
from astraflow.weights.server import WeightServer
from tests.ports import free_port

QUIET_S = 1.0
"""How long a refused peer waits to be sure nothing comes back."""


class Cluster:
    """A controller started with a key store, and key pairs for members on its registry."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = KeyStore.init(tmp / "keys")
        self.controller_public = self.store.controller_keypair().public
        self.pairs: dict[str, KeyPair] = {}
        for name, role, policy in (
            ("raas-1", "raas", None),
            ("raas-2", "raas", None),
            ("raas-3", "raas", None),
            ("obs", "observer", None),
            ("trainer-main", "trainer", "main"),
        ):
            self.pairs[name] = self.key(name)
            self.store.add(name, self.pairs[name].public, role, policy)
        self.stranger = self.key("stranger")  # never added
        self.proc, self.addr = start_controller(tmp / "ctl", keys=tmp / "keys")
        self.run_dir = tmp / "ctl" / "run"

    def key(self, name: str) -> KeyPair:
        _, secret = new_key_files(self.tmp / "member-keys", name)
        return load_keypair(secret)

    def creds(self, name: str) -> MemberCredentials:
        return MemberCredentials(self.pairs[name], self.controller_public)

    def client(self, name: str, role: str = "raas") -> MemberClient:
        hello = Hello(member_id=name, role=role, protocol=PROTOCOL_VERSION, policies=["main"], slots=2)
        return MemberClient(self.addr, hello, connect_timeout_s=15, credentials=self.creds(name))

    def members(self) -> dict[str, str]:
        return {m["id"]: m["status"] for m in read_status(self.run_dir).get("members", [])}


class Raw:
    """A raw CURVE DEALER with any key pair and any routing id."""

    def __init__(self, addr: str, pair: KeyPair, server: bytes, ident: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, ident.encode())
        curve_client(self.sock, pair, server)
        self.sock.connect(addr)

    def ask(self, msg: Msg, wait_s: float = QUIET_S) -> Msg | None:
        try:
            # after a failed handshake there is no connection to queue to: the send itself fails
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(wait_s)
            return None
        if not self.sock.poll(int(wait_s * 1000)):
            return None
        return decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("curve"))
    try:
        yield c
    finally:
        c.proc.kill()
        c.proc.wait()


def _hello(name: str, role: str = "raas", rid: int = 1) -> Hello:
    return Hello(rid=rid, member_id=name, role=role, protocol=PROTOCOL_VERSION, policies=["main"], slots=2)


def test_unknown_key_delivers_nothing(cluster: Cluster) -> None:
    before = cluster.members()
    raw = Raw(cluster.addr, cluster.stranger, cluster.controller_public, "raas-9")
    try:
        assert raw.ask(_hello("raas-9")) is None
        assert raw.ask(StatusRequest(rid=2)) is None
        assert raw.ask(TaskRequest(rid=3, n=64)) is None
    finally:
        raw.close()
    # a plain (unencrypted) peer gets nothing either
    ctx: zmq.Context[Any] = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(cluster.addr)
    try:
        plain.send(encode(_hello("raas-9")), zmq.NOBLOCK)
    except zmq.Again:
        pass
    assert not plain.poll(int(QUIET_S * 1000))
    plain.close(0)
    ctx.term()
    assert cluster.members() == before and "raas-9" not in before


def test_revoked_key_delivers_nothing_even_on_its_open_connection(cluster: Cluster) -> None:
    client = cluster.client("raas-3")
    try:
        assert isinstance(client.connect(), Welcome)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "astraflow",
                "keys",
                "revoke",
                "raas-3",
                "--keys",
                str(cluster.tmp / "keys"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        time.sleep(0.5)
        before = read_status(cluster.run_dir)["tasks"]
        with pytest.raises(ConnectError):
            client.request(TaskRequest(n=2), timeout_s=QUIET_S)
        assert read_status(cluster.run_dir)["tasks"] == before
    finally:
        client.close()
    fresh = Raw(cluster.addr, cluster.pairs["raas-3"], cluster.controller_public, "raas-3")
    try:
        assert fresh.ask(_hello("raas-3", rid=5)) is None
    finally:
        fresh.close()


def test_a_key_acts_only_under_its_own_id_and_role(cluster: Cluster) -> None:
    victim = cluster.client("raas-2")
    try:
        assert isinstance(victim.connect(), Welcome)
        # raas-1's key, routing id raas-1, Hello claiming raas-2: refused
        raw = Raw(cluster.addr, cluster.pairs["raas-1"], cluster.controller_public, "raas-1")
        reply = raw.ask(_hello("raas-2", rid=11), wait_s=10)
        assert isinstance(reply, Error) and reply.code == "bad_identity" and reply.rid == 11
        # a raas key cannot join as a trainer
        reply = raw.ask(_hello("raas-1", role="trainer", rid=12), wait_s=10)
        assert isinstance(reply, Error) and reply.code == "bad_identity"
        raw.close()
        # raas-1's key under routing id raas-9 or raas-2: its frames are raas-1's, whatever the routing id
        for ident in ("raas-9", "raas-2"):
            raw = Raw(cluster.addr, cluster.pairs["raas-1"], cluster.controller_public, ident)
            reply = raw.ask(Heartbeat(rid=13), wait_s=10)
            assert isinstance(reply, Error) and reply.code == "unknown_member" and "'raas-1'" in reply.message
            raw.close()
        # the real raas-2 is untouched: it still gets its own answers
        assert isinstance(victim.request(TaskRequest(n=1), timeout_s=10), TaskGrant)
        members = cluster.members()
        assert members.get("raas-2") == "alive" and "raas-9" not in members
        assert all(not name.startswith("trainer") for name in members)
    finally:
        victim.close()


def test_a_squatted_routing_id_does_not_keep_the_member_out(cluster: Cluster) -> None:
    # an observer key connects first under the trainer's member id and claims it: refused
    squatter = Raw(cluster.addr, cluster.pairs["obs"], cluster.controller_public, "trainer-main")
    try:
        reply = squatter.ask(_hello("trainer-main", role="trainer", rid=21), wait_s=10)
        assert isinstance(reply, Error) and reply.code == "bad_identity" and reply.rid == 21
        # while its connection stays open, the real trainer joins at once, and it alone is answered
        hello = Hello(member_id="trainer-main", role="trainer", protocol=PROTOCOL_VERSION, policies=["main"])
        trainer = MemberClient(
            cluster.addr, hello, connect_timeout_s=15, credentials=cluster.creds("trainer-main")
        )
        try:
            assert isinstance(trainer.connect(), Welcome)
            assert cluster.members().get("trainer-main") == "alive"
            # the squatter's frames still speak for its own key only
            reply = squatter.ask(Heartbeat(rid=22), wait_s=10)
            assert isinstance(reply, Error) and reply.code == "unknown_member" and "'obs'" in reply.message
        finally:
            trainer.close()
    finally:
        squatter.close()


def test_observer_key_reads_status_over_the_cli(cluster: Cluster) -> None:
    key = cluster.tmp / "member-keys" / "obs.key_secret"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "status",
            "--controller",
            cluster.addr,
            "--key",
            str(key),
            "--controller-key",
            str(cluster.tmp / "keys" / "controller.key"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert '"members"' in done.stdout
    raw = Raw(cluster.addr, cluster.pairs["obs"], cluster.controller_public, "obs")
    try:
        assert isinstance(raw.ask(StatusRequest(rid=4), wait_s=10), StatusReply)
    finally:
        raw.close()


def test_open_bind_without_keys_is_refused(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(
        '{"run": {"name": "x", "steps": 1}, "policy": [{"name": "main", "model": "unused"}],'
        ' "workflow": {"name": "quickstart"}}'
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "controller",
            str(tmp_path / "r.json"),
            "--run-dir",
            str(tmp_path / "run"),
        ]
        + ["--bind", f"tcp://0.0.0.0:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2 and "without authentication" in done.stderr


def test_weight_server_admits_only_member_keys(tmp_path: Path) -> None:
    store = KeyStore.init(tmp_path / "keys")
    pairs = {}
    for name in ("trainer-main", "raas-1", "stranger", "obs"):
        _, secret = new_key_files(tmp_path / "m", name)
        pairs[name] = load_keypair(secret)
    store.add("trainer-main", pairs["trainer-main"].public, "trainer", "main")
    store.add("raas-1", pairs["raas-1"].public, "raas")
    store.add("obs", pairs["obs"].public, "observer")
    server = WeightServer(chunk_bytes=1 << 16, keypair=pairs["trainer-main"], pull_keys=store)
    blob = os.urandom(300_000)
    try:
        server.publish("main", 1, blob)
        assert "#curve=" in server.address
        from astraflow.transport import security

        security.set_member_credentials(MemberCredentials(pairs["raas-1"], b""))
        try:
            assert fetch_weights(server.address, "main", 1, timeout_s=20) == blob
            for who in ("stranger", "obs"):  # an observer key is registered, but may not pull weights
                security.set_member_credentials(MemberCredentials(pairs[who], b""))
                with pytest.raises(ConnectError):
                    fetch_weights(server.address, "main", 1, timeout_s=2)
            store.revoke("raas-1")
            security.set_member_credentials(MemberCredentials(pairs["raas-1"], b""))
            with pytest.raises(ConnectError):
                fetch_weights(server.address, "main", 1, timeout_s=2)
        finally:
            security.set_member_credentials(None)
    finally:
        server.close()


def test_weight_server_serves_few_connections_of_one_key(tmp_path: Path) -> None:
    from astraflow.transport import security
    from astraflow.weights.pull_limit import PER_KEY

    store = KeyStore.init(tmp_path / "keys")
    pairs = {}
    for name, role in (("trainer-main", "trainer"), ("raas-1", "raas"), ("raas-2", "raas")):
        _, secret = new_key_files(tmp_path / "m", name)
        pairs[name] = load_keypair(secret)
        store.add(name, pairs[name].public, role, "main" if role == "trainer" else None)
    server = WeightServer(chunk_bytes=1 << 16, keypair=pairs["trainer-main"], pull_keys=store)
    blob = os.urandom(200_000)
    addr = server.address.split("#", 1)[0]
    flood = [
        Raw(addr, pairs["raas-1"], pairs["trainer-main"].public, f"flood-{i}") for i in range(PER_KEY + 8)
    ]
    try:
        server.publish("main", 1, blob)
        for i, raw in enumerate(flood):  # each asks for the manifest, then only one read is attempted
            raw.sock.send(encode(WeightRequest(rid=i + 1, policy="main", version=1)))
        answered: set[int] = set()
        deadline = time.monotonic() + 60
        quiet_since = time.monotonic()
        while time.monotonic() < deadline and (len(answered) < PER_KEY or time.monotonic() - quiet_since < 2):
            for i, raw in enumerate(flood):
                if i not in answered and raw.sock.poll(10):
                    raw.sock.recv()
                    answered.add(i)
                    quiet_since = time.monotonic()
        assert len(answered) == PER_KEY, f"{len(answered)} connections of one key served"
        # another key still pulls at once
        security.set_member_credentials(MemberCredentials(pairs["raas-2"], b""))
        try:
            assert fetch_weights(server.address, "main", 1, timeout_s=20) == blob
        finally:
            security.set_member_credentials(None)
    finally:
        for raw in flood:
            raw.close()
        server.close()

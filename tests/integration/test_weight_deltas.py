"""The ZeroMQ pull path with deltas and relays, over real weight servers, real sockets and real CURVE:
the same bytes arrive by delta chain as by full; a new or far-behind worker pulls full; a wrong patch
or a pull that dies leaves the held version as it was; a relay in another process serves a second
worker, and a relay killed mid-transfer sends the worker back to the trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from astraflow.transport.keys import KeyPair
from astraflow.weights import client as wclient
from astraflow.weights.connection import PullConnection
from astraflow.weights.delta_encoder import publish_delta
from astraflow.weights.fetch import HeldWeights, fetch_version
from astraflow.weights.manifest import blob_digest
from astraflow.weights.publisher import BackgroundPublisher
from astraflow.weights.server import WeightServer
from astraflow.weights.snapshot import state_dict_to_bytes

ROOT = Path(__file__).resolve().parents[2]
POLICY = "main"


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    """n consecutive bf16 versions where about 1% of the elements change each step."""
    torch.manual_seed(0)
    sd = {"w": torch.randn(256, 256).to(torch.bfloat16), "b": torch.randn(256).to(torch.bfloat16)}
    out = [sd]
    for _ in range(n - 1):
        sd = {k: v.clone() for k, v in sd.items()}
        mask = torch.rand(sd["w"].shape) < 0.01
        sd["w"][mask] += 0.5
        out.append(sd)
    return out


def _serve(server: WeightServer, versions: list[dict[str, torch.Tensor]]) -> list[str]:
    """Publish every version (and its delta) as the trainer does; their sha256s."""
    shas = []
    for v, sd in enumerate(versions):
        blob = state_dict_to_bytes(sd)
        manifest = server.publish(POLICY, v, blob)
        publish_delta(server, POLICY, v, blob, manifest)
        shas.append(manifest.sha256)
    return shas


@pytest.fixture
def trainer() -> Iterator[WeightServer]:
    server = WeightServer(keypair=KeyPair(*zmq.curve_keypair()), keep_versions=6, keep_deltas=10)
    yield server
    server.close()


def test_chain_catch_up_gives_the_same_bytes_as_full(trainer: WeightServer) -> None:
    versions = _versions(5)
    shas = _serve(trainer, versions)
    assert trainer.deltas(POLICY) == [1, 2, 3, 4]
    held = HeldWeights()
    # a new worker pulls full
    first = fetch_version([trainer.address], POLICY, 1, expect_sha256=shas[1], held=held, delta=True)
    assert first.kind == "full"
    # three versions behind: the chain of three deltas, far smaller than the version
    got = fetch_version([trainer.address], POLICY, 4, expect_sha256=shas[4], held=held, delta=True)
    assert (got.kind, got.chain) == ("delta", 3)
    full = wclient.fetch_weights(trainer.address, POLICY, 4)
    assert got.nbytes < len(full) / 5
    entry = held.get(POLICY)
    assert entry is not None and bytes(entry.blob) == bytes(full)
    assert all(
        torch.equal(got.state_dict[k].view(torch.int16), versions[4][k].view(torch.int16)) for k in "wb"
    )


def test_too_far_behind_or_deltas_off_pulls_full(trainer: WeightServer) -> None:
    shas = _serve(trainer, _versions(5))
    held = HeldWeights()
    fetch_version([trainer.address], POLICY, 0, expect_sha256=shas[0], held=held, delta=True)
    got = fetch_version(
        [trainer.address], POLICY, 4, expect_sha256=shas[4], held=held, delta=True, max_chain=2
    )
    assert got.kind == "full"
    got = fetch_version([trainer.address], POLICY, 4, expect_sha256=shas[4], held=held, delta=True)
    assert got.kind == "held" and got.nbytes == 0


def _held_back_publisher(
    trainer: WeightServer, monkeypatch: pytest.MonkeyPatch, versions: list[dict[str, torch.Tensor]]
) -> tuple[threading.Event, BackgroundPublisher, list[str]]:
    """A delta publisher whose encode waits for the returned gate (a stand-in for a slow encode: the
    real encoder, held back), with versions 1 and 2 served and announced; their sha256s."""
    import astraflow.weights.delta as delta_mod

    gate, real = threading.Event(), delta_mod.host_parts

    def held_back(*args: object) -> object:
        assert gate.wait(30)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(delta_mod, "host_parts", held_back)
    pub = BackgroundPublisher(trainer, POLICY, delta=True)
    shas = []
    for v in (1, 2):
        pub.start(v, versions[v], {})
        shas.append(pub.result(timeout_s=30).manifest.sha256)
    return gate, pub, shas


def test_a_worker_that_asks_before_the_delta_is_held_pulls_full_then_deltas_again(
    trainer: WeightServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer serves (and announces) a version before its delta is encoded: a worker that asks
    then pulls the full version; the next version comes by delta. The slow encode is a stand-in (the
    real encoder, held back by the test's event)."""
    versions = _versions(4)
    gate, pub, shas = _held_back_publisher(trainer, monkeypatch, versions)
    held = HeldWeights()
    fetch_version([trainer.address], POLICY, 1, expect_sha256=shas[0], held=held, delta=True)
    got = fetch_version([trainer.address], POLICY, 2, expect_sha256=shas[1], held=held, delta=True)
    assert got.kind == "full" and held.counts["fallback"] == 1 and trainer.deltas(POLICY) == []
    gate.set()
    pub.start(3, versions[3], {})
    sha3 = pub.result(timeout_s=30).manifest.sha256
    assert pub.deltas is not None and pub.deltas.wait_idle(30)
    assert trainer.deltas(POLICY) == [2, 3]
    got = fetch_version([trainer.address], POLICY, 3, expect_sha256=sha3, held=held, delta=True)
    assert (got.kind, got.chain) == ("delta", 1)
    assert torch.equal(got.state_dict["w"].view(torch.int16), versions[3]["w"].view(torch.int16))


def test_a_worker_waits_for_a_delta_still_being_encoded_rather_than_pull_the_full_version(
    trainer: WeightServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `delta_wait_s`, a worker that holds the version before asks again while the trainer says
    `not_yet` (its delta is being encoded) and patches the delta once it is held. The slow encode is a
    stand-in (the real encoder, held back by the test's event)."""
    told, real_chain = threading.Event(), wclient.fetch_chain

    def chain(*args: object, **kw: object) -> object:
        try:
            return real_chain(*args, **kw)  # type: ignore[arg-type]
        except wclient.NotYetError:
            told.set()  # the trainer said the delta is coming: the encode may go on now
            raise

    monkeypatch.setattr(wclient, "fetch_chain", chain)
    versions = _versions(3)
    gate, pub, shas = _held_back_publisher(trainer, monkeypatch, versions)
    held = HeldWeights()
    fetch_version([trainer.address], POLICY, 1, expect_sha256=shas[0], held=held, delta=True)
    out: list[object] = []
    pulling = threading.Thread(
        target=lambda: out.append(
            fetch_version(
                [trainer.address], POLICY, 2, expect_sha256=shas[1], held=held, delta=True, delta_wait_s=60
            )
        )
    )
    pulling.start()
    assert told.wait(30)
    gate.set()
    pulling.join(60)
    (got,) = out
    assert (got.kind, got.chain) == ("delta", 1) and held.counts["fallback"] == 0  # type: ignore[attr-defined]
    assert torch.equal(got.state_dict["w"].view(torch.int16), versions[2]["w"].view(torch.int16))  # type: ignore[attr-defined]
    # a delta no longer coming (encoded, or given up) is no longer waited for
    assert pub.deltas is not None and pub.deltas.wait_idle(30)
    trainer.delta_coming(POLICY, 9)
    with pytest.raises(wclient.NotYetError, match="being encoded"):
        wclient.fetch_manifest(trainer.address, POLICY, 9, kind="delta")
    trainer.delta_coming(POLICY, 9, False)
    with pytest.raises(wclient.VersionUnavailableError, match="not held"):
        wclient.fetch_manifest(trainer.address, POLICY, 9, kind="delta")


def test_a_patch_with_the_wrong_digest_is_discarded_for_full(trainer: WeightServer) -> None:
    versions = _versions(3)
    shas = _serve(trainer, versions)
    held = HeldWeights()
    fetch_version([trainer.address], POLICY, 1, expect_sha256=shas[1], held=held, delta=True)
    before = bytes(held.get(POLICY).blob)  # type: ignore[union-attr]
    # the server's delta 2 now patches one element wrongly (its own chunk checksums are consistent)
    bad = {k: v.clone() for k, v in versions[2].items()}
    bad["b"][0] += 1
    from astraflow.weights.delta import encode_delta

    wrong, _ = encode_delta(
        versions[1], bad, base_version=1, target_version=2, base_sha256=shas[1], target_sha256=shas[2]
    )
    trainer.publish(POLICY, 2, wrong, kind="delta")
    got = fetch_version([trainer.address], POLICY, 2, expect_sha256=shas[2], held=held, delta=True)
    assert got.kind == "full" and held.counts["fallback"] >= 1
    assert blob_digest(held.get(POLICY).blob) == shas[2]  # type: ignore[union-attr]
    # a version nobody can deliver with the announced digest: an error, and the held one stays
    kept = bytes(held.get(POLICY).blob)  # type: ignore[union-attr]
    assert kept != before
    with pytest.raises(Exception, match="sha256"):
        fetch_version([trainer.address], POLICY, 2, expect_sha256="0" * 64, held=held, delta=True)
    entry = held.get(POLICY)
    assert entry is not None and entry.version == 2 and bytes(entry.blob) == kept


def test_a_pull_that_dies_mid_transfer_loses_nothing(
    trainer: WeightServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = WeightServer(keypair=KeyPair(*zmq.curve_keypair()), chunk_bytes=4096)
    try:
        shas = _serve(small, _versions(2))
        held = HeldWeights()
        fetch_version([small.address], POLICY, 0, expect_sha256=shas[0], held=held)
        kept = bytes(held.get(POLICY).blob)  # type: ignore[union-attr]
        frame = PullConnection.frame  # receives each chunk's bytes
        seen: list[int] = []

        def stop_midway(self: PullConnection) -> zmq.Frame:
            seen.append(1)
            if len(seen) == 4:
                small.close()  # the server goes away after a few chunks of version 1
            return frame(self)

        monkeypatch.setattr(PullConnection, "frame", stop_midway)
        with pytest.raises(Exception, match="did not send"):
            fetch_version(
                [small.address], POLICY, 1, expect_sha256=shas[1], held=held, window=1, idle_timeout_s=1.0
            )
        entry = held.get(POLICY)
        assert entry is not None and entry.version == 0 and bytes(entry.blob) == kept
    finally:
        small.close()


_RELAY = textwrap.dedent(
    """
    import sys, time
    from astraflow.weights.fetch import HeldWeights, fetch_version
    from astraflow.weights.server import WeightServer
    from astraflow.transport.keys import KeyPair
    import zmq
    addr, sha = sys.argv[1], sys.argv[2]
    relay = WeightServer(keypair=KeyPair(*zmq.curve_keypair()), chunk_bytes=4096, relay=True, keep_deltas=4)
    held = HeldWeights(relay)
    fetch_version([addr], "main", 1, expect_sha256=sha, held=held)
    print(relay.address, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def relay_proc(trainer: WeightServer) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    shas = _serve(trainer, _versions(2))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RELAY, trainer.address, shas[1]], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().strip()
        assert addr.startswith("tcp://"), addr
        yield proc, addr, shas
    finally:
        proc.kill()
        proc.wait()


def test_a_relay_serves_a_second_worker(
    trainer: WeightServer, relay_proc: tuple[subprocess.Popen[str], str, list[str]]
) -> None:
    _, relay, shas = relay_proc
    held = HeldWeights()
    got = fetch_version([relay, trainer.address], POLICY, 1, expect_sha256=shas[1], held=held, delta=True)
    assert got.source == relay and got.kind == "full" and held.counts["relay"] == 1
    assert blob_digest(held.get(POLICY).blob) == shas[1]  # type: ignore[union-attr]
    # a version the relay does not hold yet: it says so, and the worker goes to the trainer after waiting
    with pytest.raises(wclient.NotYetError):
        wclient.fetch_manifest(relay, POLICY, 2)


def test_a_failed_pull_returns_only_after_every_chunk_copy_into_its_buffer_ended(
    trainer: WeightServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks are copied into the destination by the hashing threads; a pull that fails must not
    return while one still writes there (the buffer goes back to a pool and serves the next pull)."""
    import time

    from astraflow.weights import chunk_pull

    small = WeightServer(keypair=KeyPair(*zmq.curve_keypair()), chunk_bytes=4096)
    place = chunk_pull._place
    started, ended = [0], [0]
    lock = threading.Lock()

    def slow_place(frame: zmq.Frame, dest: memoryview) -> str:
        with lock:
            started[0] += 1
        time.sleep(0.3)  # a copy still running when the pull gives up
        out = place(frame, dest)
        with lock:
            ended[0] += 1
        return out

    frame = PullConnection.frame
    seen: list[int] = []

    def stop_midway(self: PullConnection) -> zmq.Frame:
        seen.append(1)
        if len(seen) == 3:
            small.close()
        return frame(self)

    try:
        shas = _serve(small, _versions(2))
        monkeypatch.setattr(chunk_pull, "_place", slow_place)
        monkeypatch.setattr(PullConnection, "frame", stop_midway)
        with pytest.raises(Exception, match="did not send"):
            fetch_version(
                [small.address], POLICY, 1, expect_sha256=shas[1], held=HeldWeights(), idle_timeout_s=1.0
            )
        with lock:
            assert started[0] >= 1 and ended[0] == started[0]
    finally:
        small.close()


def test_a_relay_killed_mid_transfer_sends_the_worker_to_the_trainer(
    trainer: WeightServer,
    relay_proc: tuple[subprocess.Popen[str], str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc, relay, shas = relay_proc
    frame = PullConnection.frame  # receives each chunk's bytes
    seen: list[int] = []
    killed: list[int] = []

    def kill_midway(self: PullConnection) -> zmq.Frame:
        seen.append(1)
        if len(seen) == 4 and not killed:
            os.kill(proc.pid, signal.SIGKILL)  # the relay dies after a few chunks of the version
            killed.append(len(seen))
        return frame(self)

    monkeypatch.setattr(PullConnection, "frame", kill_midway)
    held = HeldWeights()
    got = fetch_version(
        [relay, trainer.address], POLICY, 1, expect_sha256=shas[1], held=held, window=1, idle_timeout_s=1.0
    )
    assert killed and got.source == trainer.address and held.counts["fallback"] == 1
    assert blob_digest(held.get(POLICY).blob) == shas[1]  # type: ignore[union-attr]

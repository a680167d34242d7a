"""The weight transports' contract on real processes: the same bytes arrive on every path, a
version is never overwritten while a worker reads it, a worker that dies mid-transfer neither loses
anything nor blocks the trainer, and a worker that joins late gets the current version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from astraflow.weights import packed  # noqa: E402
from astraflow.weights.transport import SharedTransport  # noqa: E402
from tests.integration.weight_peer import sums  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def weights(step: int) -> dict[str, Any]:
    """A small model's state dict at a training step: mixed dtypes, tied and empty tensors."""
    g = torch.Generator().manual_seed(step)
    emb = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    return {
        "embed.weight": emb,
        "lm_head.weight": emb,
        "layer.0.w": torch.randn(16, 16, generator=g),
        "layer.0.b": torch.randn(16, generator=g).half(),
        "layer.0.count": torch.tensor([step], dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }


class Peer:
    """A weight peer process (tests/integration/weight_peer.py)."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.weight_peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"weight peer exited with {self.proc.wait()}"
        return dict(json.loads(line))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.kill()


def test_packed_layout_round_trips_and_digest_sees_one_byte() -> None:
    w = weights(1)
    layout = packed.plan(w)
    assert packed.Layout.from_json(layout.to_json()) == layout
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    packed.pack(w, layout, buf)
    assert sums(packed.views(buf, layout)) == sums(w)
    before = packed.digest(buf)
    buf[layout.nbytes // 2] ^= 1
    assert packed.digest(buf) != before
    with pytest.raises(ValueError):
        packed.Layout.from_json(layout.to_json().replace(b'"float32"', b'"float99"'))


def test_shared_memory_double_buffering_in_real_processes(peers: list[Peer]) -> None:
    trainer = SharedTransport(torch.device("cpu"), policy="p", slots=2)
    try:
        reader = Peer("shm")
        peers.append(reader)
        v1 = trainer.publish(1, weights(1))
        assert v1 is not None and v1.kind == "shm"
        got = reader.ask(f"recv 1 {v1.path} {v1.digest}")
        assert got == {"version": 1, "sums": sums(weights(1))}  # the same bytes arrive
        # the reader holds version 1: versions 2 and 3 go to the other slot, never over version 1
        v2 = trainer.publish(2, weights(2))
        v3 = trainer.publish(3, weights(3))
        assert v2 is not None and v3 is not None and v2.path != v1.path and v3.path == v2.path
        assert reader.ask("check")["sums"] == sums(weights(1))
        # a stale offer (its slot moved on) and a wrong digest are refused, nothing handed out
        assert reader.ask(f"recv 2 {v2.path} {v2.digest}") == {"error": "StaleOfferError"}
        assert reader.ask(f"recv 3 {v3.path} f1:0:0:0") == {"error": "WeightIntegrityError"}
        assert reader.ask("release") == {"released": True}
        v4 = trainer.publish(4, weights(4))
        assert v4 is not None and v4.path == v1.path
        # a reader killed while holding a slot releases it with its death: the trainer never waits
        assert reader.ask(f"recv 4 {v4.path} {v4.digest}")["version"] == 4
        v5 = trainer.publish(5, weights(5))
        assert v5 is not None and v5.path == v3.path
        reader.kill()
        v6 = trainer.publish(6, weights(6))
        assert v6 is not None and v6.path == v4.path
        late = Peer("shm")
        peers.append(late)
        assert late.ask(f"recv 6 {v6.path} {v6.digest}") == {"version": 6, "sums": sums(weights(6))}
        # every slot held (versions 5 and 6): no offer for version 7, and no wait either
        assert late.ask(f"recv 5 {v5.path} {v5.digest}")["version"] == 5
        assert trainer.publish(7, weights(7)) is None
        assert late.ask("check")["sums"] == sums(weights(5))
    finally:
        trainer.close()
    assert not Path(v1.path).exists()


def test_broadcast_over_gloo_with_a_late_joiner_and_a_death(peers: list[Peer]) -> None:
    from astraflow.weights.broadcast import BroadcastHub

    hub = BroadcastHub("127.0.0.1", "127.0.0.1", torch.device("cpu"), bucket_bytes=1000, timeout_s=5.0)
    try:
        first, doomed = (
            Peer("bcast", hub.address, hub.token, "w1"),
            Peer("bcast", hub.address, hub.token, "w2"),
        )
        peers += [first, doomed]
        # a version published before anyone joined is not packed; each joiner then gets the next one
        while len(hub.members) < 2:
            assert hub.publish(0, weights(0)) in ("", packed.digest(_packed(weights(0))))
            hub._thread.join(0.2)
        v = 1
        digest = hub.publish(v, weights(v))
        assert digest == packed.digest(_packed(weights(v)))
        for p in (first, doomed):
            got = _until(p, v)
            assert got["ok"] and got["sums"] == sums(weights(v))  # the same bytes arrive
        doomed.kill()  # dies: the next broadcast fails, the hub drops the generation
        late = Peer("bcast", hub.address, hub.token, "w3")
        peers.append(late)
        for v in range(2, 5):
            hub.publish(v, weights(v))  # returns at once: the sender thread does the rest
        got_first, got_late = _until(first, 4), _until(late, 4)
        assert got_first["sums"] == got_late["sums"] == sums(weights(4))
        assert got_first["ok"] and got_late["ok"]
    finally:
        hub.close()


def big(step: int) -> dict[str, Any]:
    """A version of about 1 MB: hundreds of 4 KiB buckets, so a transfer takes many collectives."""
    w = weights(step)
    w["layer.1.w"] = torch.randn(512, 512, generator=torch.Generator().manual_seed(step))
    return w


def test_broadcast_a_joiner_mid_transfer_catches_up_and_a_death_mid_transfer_loses_nothing(
    peers: list[Peer],
) -> None:
    from astraflow.weights.broadcast import BroadcastHub

    hub = BroadcastHub("127.0.0.1", "127.0.0.1", torch.device("cpu"), bucket_bytes=4096, timeout_s=60.0)
    try:
        # the survivor's collective waits for the hub until its own timeout (10 s) after the death:
        # a dropped gloo group is not aborted on the other members; it then joins the next generation
        steady = Peer("bcast", hub.address, hub.token, "w1", "10")
        doomed = Peer("bcast", hub.address, hub.token, "w2", "60", "40")  # hangs 40 collectives into v2
        peers += [steady, doomed]
        while len(hub.members) < 2:
            hub.publish(0, big(0))
            hub._thread.join(0.2)
        hub.publish(1, big(1))
        for p in (steady, doomed):
            assert _until(p, 1)["sums"] == sums(big(1))
        hub.publish(2, big(2))
        assert doomed.read() == {"mid": True}  # version 2 is on its way: 40 of its ~270 collectives done
        joins = int(hub.store.add(f"{hub.token}/njoin", 0))
        late = Peer("bcast", hub.address, hub.token, "w3", "60")  # joins while the transfer hangs
        peers.append(late)
        while int(hub.store.add(f"{hub.token}/njoin", 0)) == joins:
            hub._thread.join(0.05)  # until the newcomer is registered
        doomed.kill()  # dies mid-transfer: the hub drops the generation, the others register again
        # nothing lost: the steady worker and the newcomer both get version 2 whole, then version 3
        got_steady, got_late = _until(steady, 2), _until(late, 2)
        assert got_steady["version"] == got_late["version"] == 2
        assert got_steady["ok"] and got_late["ok"] and got_steady["sums"] == got_late["sums"] == sums(big(2))
        hub.publish(3, big(3))
        assert _until(steady, 3)["sums"] == _until(late, 3)["sums"] == sums(big(3))
        assert hub.members and all(not m.startswith("w2#") for m in hub.members)
    finally:
        hub.close()


def _packed(w: dict[str, Any]) -> Any:
    layout = packed.plan(w)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    packed.pack(w, layout, buf)
    return buf


def _until(peer: Peer, version: int) -> dict[str, Any]:
    while True:
        got = peer.read()
        if got["version"] >= version:
            return got

"""The RaaS weight pipeline: the per-policy state machine alone, then driven over real transports
(a shared-memory slot and a real weight server) into a small engine stand-in."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from astraflow.protocol.messages import VersionInfo, WeightOffer
from astraflow.roles.weight_sync import PolicySync, State

torch = pytest.importorskip("torch")


def info(
    version: int, addr: str = "tcp://t:1", sha: str = "s", offers: list[WeightOffer] | None = None
) -> VersionInfo:
    return VersionInfo(policy="p", version=version, weights_addr=addr, sha256=sha, offers=offers or [])


def test_state_machine_fetch_stage_apply() -> None:
    ps = PolicySync("p", engine_version=0)
    v1 = info(1)
    assert ps.on_announce(v1, now=0.0) and ps.state is State.FETCHING
    assert not ps.on_announce(v1, now=0.0)  # already fetching it
    assert ps.on_fetched(v1) and ps.state is State.STAGED and ps.pending
    assert not ps.on_announce(info(1), now=0.0)  # staged already
    ps.on_engine(1)
    assert ps.state is State.APPLIED and not ps.pending
    assert not ps.on_announce(info(1), now=9.0)


def test_state_machine_supersede_fail_retry_reject() -> None:
    ps = PolicySync("p")
    v1, v2 = info(1), info(2)
    assert ps.on_announce(v1, 0.0) and ps.on_announce(v2, 0.0)  # a newer version supersedes the fetch
    assert not ps.on_fetched(v1)  # the late finisher is dropped
    ps.on_failed(v2, now=1.0)
    assert ps.state is State.IDLE
    assert not ps.on_announce(v2, now=1.1)  # retried only after RETRY_S
    assert ps.on_announce(v2, now=2.0)
    assert ps.on_fetched(v2)
    ps.on_rejected(v2)
    assert ps.state is State.REJECTED and not ps.pending
    assert not ps.on_announce(info(2), now=10.0)  # never fetched again
    assert ps.on_announce(info(2, addr="tcp://new:1"), now=10.0)  # re-served by a restarted trainer
    assert not PolicySync("p", engine_version=3).on_announce(info(2), 0.0)  # older than held
    assert not PolicySync("p").on_announce(info(1, addr="", offers=[]), 0.0)  # nothing to fetch from


class DictEngine:
    """An engine stand-in: checks weights like the torch engine and applies them on its own thread."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = {k: v.clone() for k, v in params.items()}
        self.version = 0
        self._applied = threading.Condition()

    def load_weights(self, version: int, sd: dict[str, Any]) -> None:
        from astraflow.engines.weights import check_weights

        tensors = check_weights(self.params, sd)

        def apply() -> None:
            for k, v in tensors.items():
                self.params[k].copy_(v)
            with self._applied:
                self.version = version
                self._applied.notify_all()

        threading.Thread(target=apply).start()

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        with self._applied:
            return self._applied.wait_for(lambda: self.version >= version, timeout)


def test_pipeline_falls_back_and_a_mismatch_keeps_the_old_weights() -> None:
    from astraflow.metrics.role_stats import PullStats
    from astraflow.roles.weight_sync import WeightSync
    from astraflow.weights.server import WeightServer
    from astraflow.weights.snapshot import state_dict_to_bytes
    from astraflow.weights.transport import SharedTransport, ZmqTransport

    old = {"w": torch.zeros(4, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}
    new = {"w": torch.ones(4, 4), "b": torch.full((4,), 2.0, dtype=torch.bfloat16)}
    engine = DictEngine(old)
    trainer = SharedTransport(torch.device("cpu"), policy="p")
    server = WeightServer("127.0.0.1", chunk_bytes=1024)
    worker = SharedTransport(torch.device("cpu"))
    sync = WeightSync({"p": engine}, {"shm": worker, "zmq": ZmqTransport()}, ["ipc", "zmq"], PullStats())

    async def run(v: VersionInfo) -> None:
        sync.poll({"p": v})
        await sync.until_settled(30.0)

    async def scenario() -> None:
        # version 1 by shared memory
        o1 = trainer.publish(1, new)
        assert o1 is not None
        m1 = server.publish("p", 1, state_dict_to_bytes(new))
        await run(info(1, server.address, m1.sha256, [o1]))
        assert sync.paths["p"] == "shm" and engine.version == 1
        assert torch.equal(engine.params["w"], new["w"]) and torch.equal(engine.params["b"], new["b"])
        # version 2's shared offer has a wrong digest: the pull over ZeroMQ brings it instead
        two = {k: v * 3 for k, v in new.items()}
        o2 = trainer.publish(2, two)
        assert o2 is not None
        bad = WeightOffer(kind=o2.kind, host=o2.host, path=o2.path, digest="f1:0:0:0")
        m2 = server.publish("p", 2, state_dict_to_bytes(two))
        await run(info(2, server.address, m2.sha256, [bad]))
        assert sync.paths["p"] == "zmq" and engine.version == 2 and torch.equal(engine.params["w"], two["w"])
        # version 3 does not fit the model on any path: rejected, version 2 stays
        wrong = {"w": torch.ones(5, 5)}
        m3 = server.publish("p", 3, state_dict_to_bytes(wrong))
        await run(info(3, server.address, m3.sha256))
        assert sync.policies["p"].state is State.REJECTED and "could not apply" in sync.last_error
        assert engine.version == 2 and torch.equal(engine.params["w"], two["w"])

    try:
        asyncio.run(scenario())
    finally:
        trainer.close()
        server.close()


def test_choose_orders_paths_and_a_same_host_worker_never_joins_the_broadcast() -> None:
    from astraflow.weights.shared_buffer import host_id
    from astraflow.weights.transport import BroadcastTransport, SharedTransport, ZmqTransport, choose

    cpu = torch.device("cpu")
    bc = BroadcastTransport(cpu, member_id="w1")
    ts = {"shm": SharedTransport(cpu), "broadcast": bc, "zmq": ZmqTransport()}
    shm = WeightOffer(kind="shm", host=host_id(), path="/dev/shm/x", digest="d")
    other = WeightOffer(kind="shm", host="elsewhere/boot", path="/dev/shm/x", digest="d")
    ipc = WeightOffer(kind="cuda_ipc", host=host_id(), path="/dev/shm/x", digest="d")
    cast = WeightOffer(kind="broadcast", address="127.0.0.1:1", token="t", digest="d")
    got = choose(info(1, offers=[cast, ipc, shm]), ts, ["ipc", "broadcast", "zmq"])
    assert [(t.kind, o.kind if o else None) for t, o in got] == [("shm", "shm"), ("zmq", None)]
    assert not bc._members  # the CPU engine cannot take cuda_ipc; shm wins; no group joined
    assert [t.kind for t, _ in choose(info(1, offers=[other]), ts, ["ipc", "zmq"])] == ["zmq"]
    assert choose(info(1, sha="", offers=[shm]), ts, ["zmq"]) == []  # blob not served yet

"""The trainer's publishing: the trainer's thread only hands a snapshot over; the check and the fast
transports run on a worker thread and the trainer's thread announces, in order, once offers are ready.

The fast transport and the controller client here are stand-ins (a transport whose publish waits
for the test; a client that records announcements): the weight server is real."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from astraflow.protocol.messages import Ack, VersionPublished, WeightOffer
from astraflow.roles.trainer_publish import VersionAnnouncer
from astraflow.weights.server import WeightServer


class _FakeClient:
    """Records VersionPublished messages and acknowledges them (a stand-in for the controller)."""

    def __init__(self) -> None:
        self.sent: list[VersionPublished] = []
        self.thread_ids: set[int] = set()

    def request(self, msg: Any, timeout_s: float = 10.0) -> Any:
        self.thread_ids.add(threading.get_ident())
        self.sent.append(msg)
        return Ack(rid=msg.rid, detail="recorded")


class _GatedTransport:
    """A fast transport whose publish waits until the test opens the gate (a stand-in)."""

    kind = "shm"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.seen: list[tuple[int, float]] = []

    def publish(self, version: int, weights: dict[str, Any]) -> WeightOffer:
        assert self.gate.wait(10)
        self.seen.append((version, float(weights["w"][0])))
        return WeightOffer(kind="shm", host="h", path=f"/slot-{version}", digest=f"d{version}")

    def close(self) -> None:
        pass


@pytest.fixture
def announcer(monkeypatch: pytest.MonkeyPatch) -> Any:
    import astraflow.roles.member as member

    monkeypatch.setattr(member, "request_retrying", lambda client, msg, **kw: client.request(msg))
    server = WeightServer()
    client, fast = _FakeClient(), _GatedTransport()
    yield VersionAnnouncer(client, "p", server, [fast]), client, fast
    server.close()


def test_publish_returns_before_the_fast_transports_and_announces_in_order(announcer: Any) -> None:
    pub, client, fast = announcer
    metrics: dict[str, float] = {"loss": 1.0}
    t0 = time.monotonic()
    pub.publish(1, {"w": torch.tensor([1.0])}, metrics, started=t0)
    # the transport has not packed anything yet, and the trainer's thread is already back
    assert fast.seen == [] and pub.busy and client.sent == []
    assert metrics["trainer_publish_s"] < 5
    pub.poll()
    assert client.sent == []  # offers not ready: nothing announced yet
    fast.gate.set()
    pub._job.done.wait(10)
    pub.poll()
    sent = [(m.version, m.sha256, [o.path for o in m.offers]) for m in client.sent]
    assert sent[0] == (1, "", ["/slot-1"])  # the offers first; the blob's digest may follow at once
    assert all(v == 1 and sha for v, sha, _ in sent[1:])
    assert client.sent[0].metrics["loss"] == 1.0 and "trainer_publish_fast_s" in client.sent[0].metrics
    pub.publish(2, {"w": torch.tensor([2.0])}, {"loss": 2.0})
    pub.flush(block=True)  # announces version 2's offers, then both blobs with their digests
    versions = [(m.version, bool(m.sha256)) for m in client.sent]
    early = [v for v, served in versions if not served]
    served = [v for v, served in versions if served]
    assert early == [1, 2] and served == [1, 2]  # each kind in order; a version's offers come first
    assert versions.index((2, False)) < versions.index((2, True))
    assert fast.seen == [(1, 1.0), (2, 2.0)]
    assert client.thread_ids == {threading.get_ident()}  # only the trainer's thread used the socket


def test_weights_that_fail_the_check_are_never_offered_nor_announced(announcer: Any) -> None:
    pub, client, fast = announcer
    fast.gate.set()

    def check(weights: dict[str, Any]) -> None:
        if not bool(torch.isfinite(weights["w"]).all()):
            raise ValueError("not finite")

    pub.publish(1, {"w": torch.tensor([float("nan")])}, {"loss": 1.0}, check=check)
    pub._job.done.wait(10)
    with pytest.raises(ValueError, match="not finite"):
        pub.flush(block=False)  # what the trainer's loop calls between batch requests
    assert fast.seen == [] and client.sent == [] and not pub.busy
    assert pub.server.held("p") == []


class _SilentClient:
    """A controller that is gone: every request fails to connect (a stand-in). Records each attempt's
    timeout; one longer than the caller's give-up fails the test at once instead of waiting it out."""

    def __init__(self, most_s: float) -> None:
        self.most_s = most_s
        self.timeouts: list[float] = []

    def request(self, msg: Any, timeout_s: float = 10.0) -> Any:
        from astraflow.errors import ConnectError

        self.timeouts.append(timeout_s)
        assert timeout_s <= self.most_s, f"an attempt of {timeout_s}s past a give-up of {self.most_s}s"
        raise ConnectError("controller at tcp://gone did not answer")

    def check_reachable(self) -> None:
        pass

    def tick(self) -> None:
        pass


def test_a_stopping_trainers_last_announcement_gives_up_as_told_with_fast_offers_too() -> None:
    """A trainer stopped by a signal announces the version in flight with a short give-up (the
    launcher that stopped it stops the controller too): the fast job's announcement takes that
    give-up as well, so a gone controller costs the trainer seconds, not the default 600 s."""
    from astraflow.errors import ConnectError

    server = WeightServer()
    try:
        client, fast = _SilentClient(most_s=0.5), _GatedTransport()
        fast.gate.set()
        pub = VersionAnnouncer(client, "p", server, [fast])
        pub.publish(1, {"w": torch.tensor([1.0])}, {"loss": 1.0})
        pub._job.done.wait(10)
        with pytest.raises(ConnectError):
            pub.flush(block=True, give_up_after_s=0.5)
        assert client.timeouts and fast.seen == [(1, 1.0)]
    finally:
        server.close()


def test_a_deltas_metrics_are_announced_again_after_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The version is announced once served; its delta's metrics follow in a second announcement of
    the same version (same digest), never before the first one."""
    import astraflow.roles.member as member
    import astraflow.weights.delta as delta_mod
    from astraflow.weights.publisher import BackgroundPublisher

    monkeypatch.setattr(member, "request_retrying", lambda client, msg, **kw: client.request(msg))
    gate, real = threading.Event(), delta_mod.host_parts

    def slow_parts(*args: Any) -> Any:  # a stand-in for an encode slower than a step
        assert gate.wait(30)
        return real(*args)

    monkeypatch.setattr(delta_mod, "host_parts", slow_parts)
    server = WeightServer(keep_deltas=4)
    try:
        client = _FakeClient()
        pub = VersionAnnouncer(client, "p", server, [], BackgroundPublisher(server, "p", delta=True))
        for v in (1, 2):
            pub.publish(v, {"w": torch.arange(64.0) + (v == 2)}, {"loss": float(v)})
        pub.flush(block=True)  # version 2 is served and announced while its delta waits
        assert [(m.version, "weights_delta_bytes" in m.metrics) for m in client.sent] == [
            (1, False),
            (2, False),
        ]
        gate.set()
        assert pub.publisher.deltas.wait_idle(30)
        pub.poll()
        late = client.sent[2:]
        assert [m.version for m in late] == [2] and late[0].sha256 == client.sent[1].sha256
        assert set(late[0].metrics) >= {
            "weights_delta_bytes",
            "weights_delta_encode_s",
            "weights_delta_on_device",
        }
        assert "loss" not in late[0].metrics and late[0].offers == []
        pub.finish_deltas(1.0)  # nothing more to say
        assert len(client.sent) == 3
    finally:
        server.close()

"""The delta encoders and the encoder thread: the device path (run here with CPU tensors) makes the
same bytes as the host encoder, and a slow encode never holds the trainer's next publish.

The slow encode is a stand-in: the real encoder wrapped so it waits for the test's event."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from astraflow.weights.delta import apply_delta, assemble, encode_delta
from astraflow.weights.delta_device import device_parts
from astraflow.weights.manifest import blob_digest
from astraflow.weights.publisher import BackgroundPublisher
from astraflow.weights.server import WeightServer
from astraflow.weights.snapshot import bytes_to_state_dict, state_dict_to_bytes

HEAD: dict[str, Any] = {
    "base_version": 3,
    "target_version": 4,
    "base_sha256": "a" * 64,
    "target_sha256": "b" * 64,
}


def _pair(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions with sparse changes (first and last element among them), odd bit patterns, an
    unchanged tensor, one changed whole, one just under half changed and a scalar."""
    torch.manual_seed(0)
    base = {
        "sparse": torch.randn(257, 129).to(dtype),
        "same": torch.randn(40).to(dtype),
        "whole": torch.randn(33).to(dtype),
        "half": torch.randn(64).to(dtype),
        "scalar": torch.tensor(1.5).to(dtype),
        "ids": torch.arange(50, dtype=torch.int64),
        "mask": torch.zeros(24, dtype=torch.bool),
    }
    target = {k: v.clone() for k, v in base.items()}
    flat = target["sparse"].view(-1)
    flat[torch.rand(flat.numel()) < 0.02] += 1
    flat[0] += 1
    flat[-1] += 1
    width = {2: torch.int16, 4: torch.int32}[flat.element_size()]
    flat[7:9] = torch.tensor([0.0, -0.0], dtype=dtype)  # +0 and -0: equal as floats, not as bits
    flat.view(width)[9] = base["sparse"].view(-1).view(width)[9] ^ 1  # one bit
    target["whole"] += 1
    target["half"][:32] += 1  # exactly half: still sparse
    target["scalar"] += 1
    target["ids"][[3, 49]] = 7
    target["mask"][5] = True
    return base, target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [8, 56, 1 << 22])
def test_the_device_path_makes_the_host_encoders_bytes(dtype: torch.dtype, chunk: int) -> None:
    base, target = _pair(dtype)
    host, host_stats = encode_delta(base, target, **HEAD)
    parts = device_parts(base, target, chunk=chunk)
    assert all(t.device.type == "cpu" for t in parts.entries.values())
    dev, dev_stats = assemble(parts, **HEAD)
    assert bytes(memoryview(dev)) == bytes(memoryview(host)) and dev_stats == host_stats
    assert host_stats.dense_tensors == 2  # `whole` and `scalar` go whole; `half` stays sparse
    # and it is the delta: applied to the base it gives the target, bit for bit
    patched = {k: v.clone() for k, v in base.items()}
    apply_delta(patched, dev)
    assert all(
        torch.equal(patched[k].view(-1).view(torch.uint8), target[k].view(-1).view(torch.uint8)) for k in base
    )


def test_the_device_path_refuses_what_the_host_encoder_refuses() -> None:
    from astraflow.weights.delta import DeltaError

    base, target = _pair(torch.bfloat16)
    with pytest.raises(DeltaError, match="names differ"):
        device_parts(base, {k: v for k, v in target.items() if k != "same"})
    with pytest.raises(DeltaError, match="sparse"):
        device_parts(base, {**target, "sparse": target["sparse"].float()})
    with pytest.raises(ValueError, match="multiple of 8"):
        device_parts(base, target, chunk=12)


class _Gate:
    """Wraps an encoder so that it tells when it is entered and then waits for the test (a stand-in
    for an encode slower than a training step)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        assert self.open.wait(30)
        return self.real(*args, **kw)


@pytest.fixture
def server() -> Iterator[WeightServer]:
    s = WeightServer(chunk_bytes=1 << 12, keep_versions=4, keep_deltas=4)
    yield s
    s.close()


def _version(i: int) -> dict[str, torch.Tensor]:
    w = torch.zeros(4096, dtype=torch.bfloat16)
    w[:i] = 1.0  # version i differs from version i - 1 in one element
    return {"w": w}


@pytest.mark.parametrize("on_device", [False, True], ids=["host-path", "device-path"])
def test_a_slow_delta_never_holds_the_next_publish(
    server: WeightServer, monkeypatch: pytest.MonkeyPatch, on_device: bool
) -> None:
    import astraflow.weights.delta as delta_mod
    import astraflow.weights.delta_device as device_mod

    if on_device:
        gate = _Gate(device_mod.device_parts)
        monkeypatch.setattr(device_mod, "device_parts", gate)
    else:
        gate = _Gate(delta_mod.host_parts)
        monkeypatch.setattr(delta_mod, "host_parts", gate)
    pub = BackgroundPublisher(server, "p", delta=True, delta_on_device=on_device)
    assert pub.deltas is not None
    pub.start(1, _version(1), {})
    first = pub.result(timeout_s=30)
    assert pub.deltas.wait_idle(30) and not gate.entered.is_set()  # no base: no delta to encode
    pub.start(2, _version(2), {"loss": 1.0})
    assert gate.entered.wait(30)  # the delta of version 2 is being encoded, and stays so
    second = pub.result(timeout_s=30)  # ... yet version 2 is served, ready to announce
    assert second.version == 2 and server.held("p")[-1] == 2 and server.deltas("p") == []
    assert "weights_delta_bytes" not in second.metrics
    # the next publishes do not wait for that encode: version 3 waits its turn, and version 4, coming
    # while it waits, replaces it (version 3 gets no delta, counted)
    for v in (3, 4):
        pub.start(v, _version(v), {"loss": 1.0})
        assert pub.result(timeout_s=30).version == v
    assert gate.entered.is_set() and not gate.open.is_set() and server.deltas("p") == []
    assert pub.deltas.skipped == 1 and pub.deltas.take_late() == []
    gate.open.set()
    assert pub.deltas.wait_idle(30)
    late = pub.deltas.take_late()
    # on the host both blobs of version 4's delta are held; on the device version 3's snapshot (the base
    # it needs) was not kept: no delta for 4 either, counted
    assert [m.version for m, _ in late] == ([2] if on_device else [2, 4])
    metrics = late[0][1]
    assert metrics["weights_delta_skipped"] == 1 and metrics["weights_delta_on_device"] == float(on_device)
    assert metrics["weights_delta_bytes"] < 0.5 and metrics["weights_delta_changed"] == 1 / 4096
    assert server.deltas("p") == [m.version for m, _ in late]
    assert pub.deltas.skipped == (2 if on_device else 1)
    # the delta held is the one from version 1's bytes to version 2's
    patched = bytearray(server.blob("p", 1) or b"")
    apply_delta(bytes_to_state_dict(patched), server.blob("p", 2, "delta") or b"")
    assert blob_digest(patched) == second.manifest.sha256 != first.manifest.sha256
    pub.start(5, _version(5), {})  # and the chain goes on from there
    pub.result(timeout_s=30)
    assert pub.deltas.wait_idle(30)
    assert server.deltas("p")[-1] == 5
    assert state_dict_to_bytes(_version(5)) == bytes(server.blob("p", 5) or b"")

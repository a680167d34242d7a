"""What the engine plugins share (engines/base.StagedWeights, weights/shared_buffer.rebuild_args):
offered weights and same-host slots are checked against the checkpoint before anything is staged,
partial updates compose, a slot supersedes what is staged, a CUDA IPC slot is declined off a GPU;
and the arguments that rebuild a trainer's CUDA IPC buffer bind to torch's own rebuild function."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine, StagedWeights
from astraflow.errors import WeightsMismatchError

torch = pytest.importorskip("torch")

CHECKPOINT = {"w": torch.empty(4, 3, device="meta"), "b": torch.empty(3, dtype=torch.bfloat16, device="meta")}


class Staging(StagedWeights, RolloutEngine):
    """The staging half of an engine plugin, with no update thread: a test takes `_staged` itself."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self._init_staging(dict(CHECKPOINT))

    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        raise NotImplementedError

    @property
    def version(self) -> int:
        return self._version

    def capacity(self) -> int:
        return 1


def _slot(kind: str, weights: Mapping[str, Any], version: int = 1) -> Any:
    from astraflow.weights import packed
    from astraflow.weights.slot_ref import SlotRef

    layout = packed.plan(dict(weights))
    return SlotRef(kind, "/dev/shm/none", b"", version, "f1:0:0:0", layout.to_json())


def test_offered_weights_are_checked_before_anything_is_staged_and_partial_updates_compose() -> None:
    e = Staging()
    with pytest.raises(WeightsMismatchError):
        e.load_weights(1, {"w": torch.zeros(3, 4)})  # wrong shape
    with pytest.raises(WeightsMismatchError):
        e.load_weights(1, {"nope": torch.zeros(3)})
    assert e._staged is None
    e.load_weights(1, {"w": torch.ones(4, 3)})
    e.load_weights(2, {"b": torch.ones(3, dtype=torch.bfloat16)})
    assert e._staged is not None
    version, staged = e._staged
    assert version == 2 and isinstance(staged, dict) and sorted(staged) == ["b", "w"]


def test_a_slot_is_checked_supersedes_what_is_staged_and_is_declined_off_a_gpu() -> None:
    good = {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    e = Staging()
    e.load_weights(1, {"w": torch.ones(4, 3)})
    assert e.load_slot(2, _slot("cuda_ipc", good)) is False  # a CPU engine cannot map a device buffer
    assert e._staged is not None and e._staged[0] == 1
    with pytest.raises(WeightsMismatchError):
        e.load_slot(2, _slot("shm", {"w": torch.zeros(4, 3, dtype=torch.int32)}))  # not a float
    assert e._staged[0] == 1
    ref = _slot("shm", good, version=2)
    assert e.load_slot(2, ref) is True
    assert e._staged == (2, ref)
    # tensors offered after a slot do not merge into it: they start a new set
    e.load_weights(3, {"w": torch.ones(4, 3)})
    assert e._staged[0] == 3 and sorted(e._staged[1]) == ["w"]  # type: ignore[arg-type]


def test_an_applied_version_wakes_its_waiters_and_clears_a_refusal() -> None:
    e = Staging()
    e._refused = 2
    assert e.slot_refused(2) and not e.slot_refused(3)
    assert e.wait_version(2, timeout=0.0) is False
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(e.wait_version(2, timeout=60.0)))
    waiter.start()
    e._applied_version(2)
    waiter.join(timeout=60.0)
    assert seen == [True] and e.version == 2
    assert not e.slot_refused(2)  # a version in use is no longer refused


def test_rebuild_args_bind_to_torchs_rebuild_cuda_tensor() -> None:
    """The arguments cannot be run without a GPU (tests/contract/test_engine_plugins_gpu.py rebuilds
    them on one); here they are bound to torch's signature: the whole buffer as bytes, or a view."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from astraflow.weights.shared_buffer import IpcHandle, rebuild_args

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    h = IpcHandle(1, b"H" * 64, 4096, 512, b"R" * 8, 16, b"", True, 4096, "GPU-1")
    whole = dict(zip(params, rebuild_args(h, torch.uint8, 0), strict=True))
    assert whole["tensor_size"] == torch.Size([4096]) and whole["tensor_stride"] == (1,)
    assert whole["tensor_offset"] == 0 and whole["dtype"] is torch.uint8 and whole["storage_device"] == 0
    assert whole["storage_handle"] == h.handle and whole["storage_size_bytes"] == 4096
    assert whole["storage_offset_bytes"] == 512 and whole["requires_grad"] is False
    assert whole["ref_counter_handle"] == h.ref_handle and whole["ref_counter_offset"] == 16
    assert whole["event_handle"] is None and whole["event_sync_required"] is True
    view = dict(zip(params, rebuild_args(h, torch.float32, "GPU-1", shape=(5, 7), offset=64), strict=True))
    assert view["tensor_size"] == torch.Size([5, 7]) and view["tensor_stride"] == torch.empty(5, 7).stride()
    assert (
        view["tensor_offset"] == 64 and view["dtype"] is torch.float32 and view["storage_device"] == "GPU-1"
    )

"""The `serialized_named_tensors` of SGLang's `/update_weights_from_tensor`, built from a same-host slot.

SGLang's server takes, per tensor-parallel rank, a base64 string of a pickle (its
`MultiprocessingSerializer`: torch's `ForkingPickler` on the sender, a restricted unpickler on the
server that admits `torch.*` and `builtins.*` globals among others) of a list of (name, tensor) pairs,
with `load_format` null: the server rebuilds each tensor with torch's own rebuild functions and passes
the list to its model's `load_weights`. Tensors are never serialised by value: a CUDA tensor travels as
its CUDA IPC handle, a CPU tensor as the name of a torch shared-memory segment. So the request is a few
KiB whatever the model's size:

- `cuda_ipc` slot: each tensor is `rebuild_cuda_tensor` of the trainer's packed device buffer (its IPC
  handle from the slot reference) at the tensor's offset; the device is the GPU's UUID, which SGLang's
  patched rebuild function maps to its own device index (indices differ between processes);
- `shm` slot: the packed bytes are copied once into a torch shared-memory segment (torch's
  file_system sharing: a segment another process opens by name) and each tensor is `rebuild_tensor`
  of it at the tensor's offset. The engine reuses one segment for every version (updates are
  sequential, and the server has copied from it when it answers), so a server that refuses a request
  before opening the segment costs no memory beyond it.

This module writes these pickles (it never reads one). The facts come from SGLang's source (the
request struct, MultiprocessingSerializer, the model runner's update_weights_from_tensor and torch
reduction patch); they were checked only against the FAKE server in tests/contract/fake_sglang.py.
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from astraflow.weights import packed
from astraflow.weights.shared_buffer import IpcHandle, contiguous_stride, rebuild_args
from astraflow.weights.slot_ref import SlotRef


class _Call:
    """Pickles as `fn(*args)`: how the receiver rebuilds an object (pickle's REDUCE)."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


@dataclass
class TensorPayload:
    """One update's request fields, and what must stay alive until the server answered."""

    serialized: str
    """One rank's `serialized_named_tensors` entry (base64 of the pickle)."""
    keep: Any = None


def from_slot(
    ref: SlotRef, tensors: dict[str, torch.Tensor] | None = None, reuse: torch.Tensor | None = None
) -> TensorPayload:
    """The payload naming the version of `ref`: its CUDA IPC buffer (cuda_ipc), or for shm a shared
    copy of `tensors` (the slot's checked views, weights/slot_ref.read_slot), written into `reuse`
    (the `keep` of an earlier payload) when it is large enough."""
    layout = packed.Layout.from_json(ref.layout)
    if ref.kind == "cuda_ipc":
        return TensorPayload(_encode(_cuda_items(layout, msgspec.msgpack.decode(ref.ipc, type=IpcHandle))))
    if tensors is None:
        raise ValueError("an shm slot's payload needs its mapped tensors")
    buf, items = _shared_items(layout, tensors, reuse)
    return TensorPayload(_encode(items), keep=buf)


def _encode(items: list[tuple[str, Any]]) -> str:
    return base64.b64encode(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)).decode()


def _cuda_items(layout: packed.Layout, h: IpcHandle) -> list[tuple[str, Any]]:
    """Each tensor as torch's `rebuild_cuda_tensor` of a view of the trainer's packed buffer."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device: int | str = h.device_uuid or h.device
    out = []
    for e in layout.entries:
        dtype = getattr(torch, e.dtype)
        item = torch.empty((), dtype=dtype).element_size()
        # the offset in elements of the tensor's dtype (regions are aligned to it)
        args = rebuild_args(h, dtype, device, shape=e.shape, offset=e.offset // item)
        out.append((e.name, _Call(rebuild_cuda_tensor, args)))
    return out


def _shared_items(
    layout: packed.Layout, tensors: dict[str, torch.Tensor], reuse: torch.Tensor | None
) -> tuple[torch.Tensor, list[tuple[str, Any]]]:
    """Copy the version into one torch shared-memory segment and name each tensor as a view of it."""
    from torch.multiprocessing.reductions import (
        rebuild_storage_filename,
        rebuild_tensor,
        rebuild_typed_storage,
    )

    fits = reuse is not None and reuse.numel() >= layout.nbytes
    buf = reuse if reuse is not None and fits else torch.empty(max(layout.nbytes, 1), dtype=torch.uint8)
    storage = buf.untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()  # moves it into a segment once
    packed.pack(tensors, layout, buf)
    # the receiver's rebuild drops one reference: hold one for it, as torch's own reducer does
    storage._shared_incref()
    # one object, so the pickle names the segment once and every tensor refers to it
    shared = _Call(rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size))
    typed: dict[str, _Call] = {}
    out = []
    for e in layout.entries:
        dtype = getattr(torch, e.dtype)
        item = torch.empty((), dtype=dtype).element_size()
        view = typed.setdefault(e.dtype, _Call(rebuild_typed_storage, (shared, dtype)))
        meta = (e.offset // item, torch.Size(e.shape), contiguous_stride(e.shape), False)
        out.append((e.name, _Call(rebuild_tensor, (torch.Tensor, view, meta))))
    return buf, out

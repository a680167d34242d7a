"""A version in a same-host slot, named instead of handed over.

When a RaaS received a version through the same-host slot (weights/shared_buffer.py: a /dev/shm file on
a CPU, a CUDA IPC device buffer on a GPU), an engine that can map the slot itself (inside its own
worker, next to its weights) is given a `SlotRef` rather than tensors (`RolloutEngine.load_slot`): the
slot file, the IPC handle, the layout table and the announced digest, a few KiB whatever the model's
size. Whoever maps it checks it again (`read_slot`: the slot names the version, its layout is the
referenced one, its bytes have the announced digest) and the engine checks names, shapes and dtypes
against its model from the layout alone (`layout_meta`) before it copies anything.

The RaaS keeps its shared lock on the slot until the engine decodes with that version (or a newer
one), so the trainer never overwrites bytes an engine may still read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec
import torch

from astraflow.errors import WeightIntegrityError
from astraflow.weights import packed

if TYPE_CHECKING:
    from astraflow.weights.shared_buffer import Received, SharedImporter


class SlotRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One version held in a same-host slot: what an engine needs to map and check it itself."""

    kind: Annotated[str, msgspec.Meta(pattern="^(shm|cuda_ipc)$")]
    """shm (the bytes are in the slot file) | cuda_ipc (the bytes are on the trainer's GPU)."""
    path: Annotated[str, msgspec.Meta(max_length=1024)]
    """The slot file (header, layout table, and for shm the bytes)."""
    ipc: Annotated[bytes, msgspec.Meta(max_length=4096)]
    """cuda_ipc: the packed device buffer's IPC handle (shared_buffer.IpcHandle, msgpack); else b""."""
    version: int
    digest: Annotated[str, msgspec.Meta(max_length=128)]
    """The digest the control plane announced (packed.digest of the packed bytes)."""
    layout: bytes
    """The slot's layout table (packed.Layout.to_json): names, dtypes, shapes, offsets."""

    def encode(self) -> bytes:
        """The reference as msgpack bytes (what crosses an engine's own RPC)."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, raw: bytes) -> SlotRef:
        """Parse and validate encoded bytes (a bad field fails loudly)."""
        return msgspec.msgpack.decode(raw, type=cls)


def layout_meta(ref: SlotRef) -> dict[str, torch.Tensor]:
    """The referenced version's tensors as meta tensors (name, shape, dtype; no bytes), for
    engines/weights.check_weights before anything is mapped or copied."""
    layout = packed.Layout.from_json(ref.layout)
    return {
        e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device="meta") for e in layout.entries
    }


def read_slot(ref: SlotRef, importer: SharedImporter) -> Received:
    """Map the referenced version through `importer` (which locks the slot shared and checks the header's
    version and the digest) and check the slot's layout is the referenced one; `release` the result
    once its tensors were copied."""
    got = importer.receive(ref.kind, ref.path, ref.ipc, ref.version, ref.digest)
    if got.slot is None or got.slot.layout != ref.layout:
        got.release()
        raise WeightIntegrityError(
            f"shared slot {ref.path}: its layout is not the one referenced for version {ref.version}",
            hint="",
        )
    return got

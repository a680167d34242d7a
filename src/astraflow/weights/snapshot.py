"""Full weight snapshots as bytes: safetensors in, safetensors out, never pickle."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""safetensors' dtype names for the dtypes we write ourselves; others go through safetensors.save."""


def state_dict_to_bytes(
    sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, *, pinned: bool = False
) -> bytes | memoryview:
    """Serialize a state_dict (any device, tied weights allowed) to safetensors bytes.

    Written straight into one buffer (header, then each tensor's bytes, one copy per tensor) rather
    than through safetensors.save, which copies every tensor twice; the format is the same.
    `pinned` (device tensors, CUDA present): the buffer is page-locked host memory (torch's host
    allocator keeps freed blocks for the next version) and the copies are queued without waiting, so
    the caller must synchronise the current stream before reading the bytes. Copies into fresh
    pageable memory run at page-fault speed and hold the stream for each tensor.
    """
    meta = {"format": "pt", **(metadata or {})}
    tensors = {name: t.detach() for name, t in sd.items()}
    if any(t.dtype not in _DTYPES for t in tensors.values()):
        return _save_via_safetensors(tensors, meta)
    header, head, order, offset = _layout(tensors, meta)
    base = 8 + len(head)
    # torch.empty leaves the pages untouched (bytearray(n) zeroes them first: a second pass)
    pinned = pinned and torch.cuda.is_available() and any(t.is_cuda for t in tensors.values())
    dst = torch.empty(base + offset, dtype=torch.uint8, pin_memory=pinned)
    out = memoryview(dst.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    struct.pack_into("<Q", out, 0, len(head))
    out[8:base] = head
    if offset:
        for name in order:
            t = tensors[name]
            start, end = header[name]["data_offsets"]  # type: ignore[index]
            if end > start:
                src = t.contiguous().reshape(-1).view(torch.uint8)
                # device to host when t is not on the CPU (queued, not waited for, into pinned memory)
                dst[base + start : base + end].copy_(src, non_blocking=pinned)
    return out


def _layout(
    tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> tuple[dict[str, object], bytes, list[str], int]:
    """The safetensors header (as a dict and as padded bytes), the tensors' order and their bytes."""
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    # safetensors orders data by dtype alignment then name; any order loads, so keep it simple
    order = sorted(tensors)
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return header, head, order, offset


def blob_bytes(sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int | None:
    """The size `state_dict_to_bytes` gives `sd`, without writing it (None when it would go through
    safetensors.save: a dtype we do not write ourselves)."""
    tensors = {name: t.detach() for name, t in sd.items()}
    if any(t.dtype not in _DTYPES for t in tensors.values()):
        return None
    _, head, _, offset = _layout(tensors, {"format": "pt", **(metadata or {})})
    return 8 + len(head) + offset


def _save_via_safetensors(sd: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    seen: set[tuple[int, int | torch.SymInt, int]] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        t = tensor.to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied embeddings); give each its own copy
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()))
        flat[name] = t
    return _st_save(flat, metadata=meta)


_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def bytes_to_state_dict(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes into CPU tensors; a writable buffer (what a pull returns) is parsed in
    place, the tensors being views of it (no copy)."""
    if isinstance(blob, bytes) or memoryview(blob).readonly:
        return _st_load(bytes(blob))
    view = memoryview(blob).cast("B")
    if len(view) < 8:
        raise ValueError("not a safetensors blob: shorter than its header size")
    (hlen,) = struct.unpack_from("<Q", view, 0)
    if 8 + hlen > len(view):
        raise ValueError("not a safetensors blob: header runs past the end")
    header = json.loads(bytes(view[8 : 8 + hlen]))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors blob: header is not an object")
    base = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES.get(info.get("dtype"))
        if dtype is None:
            return _st_load(bytes(view))  # a dtype we do not map: safetensors knows them all
        start, end = (int(x) for x in info["data_offsets"])
        shape = [int(x) for x in info["shape"]]
        numel = 1
        for d in shape:
            numel *= d
        size = torch.empty((), dtype=dtype).element_size()
        if (
            not 0 <= start <= end <= len(view) - base
            or end - start != numel * size
            or min(shape, default=1) < 0
        ):
            raise ValueError(f"safetensors entry {name!r} has bad offsets or shape")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(view, dtype=torch.uint8, count=end - start, offset=base + start)
        out[name] = raw.view(dtype).reshape(shape)
    return out

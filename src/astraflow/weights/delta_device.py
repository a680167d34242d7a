"""The delta encoder of device snapshots: changed elements found where the weights live.

The trainer keeps the previous version's snapshot on its GPU (weights/delta_encoder.py); this module
compares it with the new one there, bit pattern against bit pattern, and computes the index gaps and
their byte planes there too. Only the sparse result crosses to the host: per changed element four
index bytes and its value (a tensor whose elements changed for more than half goes whole), where zlib
and the safetensors layout make the same bytes as the host encoder (weights/delta.py) for the same
inputs. The work goes through each tensor in slices of `CHUNK_ELEMENTS`, so the device memory it
takes besides the two snapshots is bounded by a slice's, whatever the tensors' sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astraflow.weights.delta import (
    IDX,
    VAL,
    DeltaParts,
    bits_of,
    changed_indices,
    check_names,
    check_pair,
    compress_planes,
    is_dense,
)

if TYPE_CHECKING:
    import torch

CHUNK_ELEMENTS = 1 << 22
"""Elements compared at a time: the device memory of one slice's work is at most about 30 bytes an
element (comparison mask, indices, gaps, byte planes, values), about 120 MiB."""


def device_parts(
    base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], chunk: int = CHUNK_ELEMENTS
) -> DeltaParts:
    """The entries of the delta that turns `base` into `target` (tensors on one device, any device),
    every entry on the host; `chunk` (a multiple of 8) elements are compared at a time."""
    if chunk <= 0 or chunk % 8:
        raise ValueError("chunk must be a positive multiple of 8")
    check_names(base, target)
    parts = DeltaParts({})
    for name, new in target.items():
        old = base[name]
        check_pair(name, old, new)
        _one_tensor(parts, name, bits_of(old), bits_of(new.to(old.device)), new, chunk)
    return parts


def _one_tensor(
    parts: DeltaParts, name: str, a: torch.Tensor, b: torch.Tensor, new: torch.Tensor, chunk: int
) -> None:
    """Add one tensor's entries (none, sparse or whole) to `parts`."""
    import torch

    numel = a.numel()
    parts.elements += numel
    planes: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    count, last = 0, 0
    for start in range(0, numel, chunk):
        idx = changed_indices(a[start : start + chunk], b[start : start + chunk])
        n = idx.numel()
        if n == 0:
            continue
        count += n
        if is_dense(count, numel):
            break  # going whole: the rest need not be looked at
        glob = idx + start
        gaps = torch.empty_like(glob)
        gaps[0] = glob[0] - last
        gaps[1:] = glob[1:] - glob[:-1]
        last = int(glob[-1])
        shifts = torch.arange(0, 32, 8, device=gaps.device).reshape(4, 1)
        planes.append(((gaps.reshape(1, -1) >> shifts) & 0xFF).to(torch.uint8).cpu())
        values.append(b[start : start + chunk][idx].cpu())
    if count == 0:
        return
    if is_dense(count, numel):
        # count may stop short of the total, but it stops only once past half, and then the total is too
        parts.changed += _count_all(a, b, chunk)
        parts.entries[name] = new.detach().contiguous().cpu()
        parts.dense += 1
        return
    parts.changed += count
    stream = b"".join(torch.cat([p[k] for p in planes]).numpy().tobytes() for k in range(4))
    parts.entries[name + IDX] = torch.frombuffer(bytearray(compress_planes(stream)), dtype=torch.uint8)
    parts.entries[name + VAL] = torch.cat(values).view(new.dtype)


def _count_all(a: torch.Tensor, b: torch.Tensor, chunk: int) -> int:
    """How many elements differ (a whole tensor's count, for the stats)."""
    return sum(int((a[s : s + chunk] != b[s : s + chunk]).sum()) for s in range(0, a.numel(), chunk))

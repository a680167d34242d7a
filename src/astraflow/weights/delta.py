"""Lossless weight deltas: the elements of a version whose bits differ from the version before it.

A delta is itself a safetensors blob (parsed by the same code as a full snapshot, never pickle). For
each tensor whose bits changed it holds either
- `NAME#idx` (U8): the flat indices of the changed elements as gaps (the first index, then each
  index minus the one before), stored as uint32, byte-shuffled (all low bytes, then the next ...)
  and zlib-compressed; and `NAME#val`: the new values of those elements, raw, in the tensor's dtype;
- or `NAME` itself: the whole new tensor, when more than half of its elements changed (an index would
  then cost more than it saves).
Tensors with no change are absent. Elements are compared by their bit patterns, so -0.0 versus 0.0 and
every NaN payload are told apart and restored exactly. The metadata names the base and target
versions and the sha256 of both full blobs: a delta is applied only to the blob it was taken from,
and the patched blob is checked against the target's digest before anyone uses it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAGIC = "astraflow-delta-1"
"""Metadata value that marks a safetensors blob as a delta of this format."""
IDX, VAL = "#idx", "#val"
"""Suffixes of a sparse entry's index stream and values."""
_ZLIB_LEVEL = 1
"""Fastest zlib level: the gaps of sparse changes are small numbers and compress well even so."""


class DeltaError(ValueError):
    """A delta that does not fit the weights it is applied to, or is not a delta at all."""


@dataclass(frozen=True)
class DeltaHeader:
    """What a delta says about itself."""

    base_version: int
    target_version: int
    base_sha256: str
    target_sha256: str


@dataclass(frozen=True)
class DeltaStats:
    """How much of a version a delta carries."""

    elements: int
    changed: int
    dense_tensors: int
    nbytes: int


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a tensor's raw bits (same memory)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().reshape(-1).view(width)


def changed_indices(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices where two bit views differ.

    Compared 8 bytes at a time first (a quarter of the comparisons and of the nonzero scan for bf16),
    then lane by lane only inside the words that differ.
    """
    import torch

    lanes = 8 // a.element_size()
    if lanes > 1 and a.numel() % lanes == 0:
        try:
            wa, wb = a.view(torch.int64), b.view(torch.int64)
        except RuntimeError:  # not 8-byte aligned in its blob: compare element by element
            pass
        else:
            words = (wa != wb).nonzero().reshape(-1)
            # the differing words' lanes (a 1-D gather of whole words, then a view as lanes)
            pos = (wa[words].view(a.dtype) != wb[words].view(a.dtype)).nonzero().reshape(-1)
            return words[pos // lanes] * lanes + pos % lanes
    return (a != b).nonzero().reshape(-1)


def _pack_indices(idx: torch.Tensor) -> bytes:
    """Gaps as uint32, byte-shuffled (all low bytes first), zlib-compressed."""
    import numpy as np

    a = idx.cpu().numpy()
    gaps = np.empty(len(a), dtype=np.uint32)
    if len(a):
        gaps[0] = a[0]
        np.subtract(a[1:], a[:-1], out=gaps[1:], casting="unsafe")
    return compress_planes(gaps.view(np.uint8).reshape(-1, 4).T.tobytes())


def compress_planes(planes: bytes) -> bytes:
    """An index stream: the gaps' byte planes (every gap's low byte, then every next byte ...),
    zlib-compressed."""
    return zlib.compress(planes, _ZLIB_LEVEL)


def _unpack_indices(packed: bytes, count: int, numel: int) -> torch.Tensor:
    import numpy as np
    import torch

    raw = zlib.decompress(packed)
    if len(raw) != 4 * count:
        raise DeltaError(f"index stream holds {len(raw) // 4} entries, expected {count}")
    gaps = np.frombuffer(raw, dtype=np.uint8).reshape(4, count).T.copy().view(np.uint32).reshape(-1)
    idx = np.cumsum(gaps, dtype=np.int64)
    if count and (idx[-1] >= numel or (count > 1 and int(gaps[1:].min()) == 0)):
        raise DeltaError("indices out of range or not increasing")
    return torch.from_numpy(idx)


@dataclass
class DeltaParts:
    """A delta's entries before its header is known, as both encoders (host here, device in
    weights/delta_device.py) hand them to `assemble`, with the counts its stats report."""

    entries: dict[str, torch.Tensor]
    elements: int = 0
    changed: int = 0
    dense: int = 0


def check_pair(name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    """Refuse a tensor that cannot be in a delta: a reserved name, or another dtype or shape."""
    if "#" in name:
        raise DeltaError(f"tensor name {name!r} contains '#', which deltas reserve")
    if old.dtype != new.dtype or old.shape != new.shape:
        raise DeltaError(f"{name}: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")


def check_names(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    """Refuse two versions whose tensor names differ."""
    if base.keys() != target.keys():
        raise DeltaError(f"tensor names differ: {sorted(base.keys() ^ target.keys())[:5]}")


def is_dense(changed: int, numel: int) -> bool:
    """Whether a tensor goes whole: more than half its elements changed (an index would then cost more
    than it saves), or too many elements for a uint32 gap."""
    return 2 * changed > numel or numel >= 1 << 32


def host_parts(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> DeltaParts:
    """The entries of the delta that turns `base` into `target`, computed where the tensors are and
    packed with numpy (the encoder of host snapshots and of blobs)."""
    import torch

    check_names(base, target)
    parts = DeltaParts({})
    for name, new in target.items():
        old = base[name]
        check_pair(name, old, new)
        a, b = bits_of(old), bits_of(new.to(old.device))
        parts.elements += a.numel()
        idx = changed_indices(a, b)
        n = idx.numel()
        parts.changed += n
        if n == 0:
            continue
        if is_dense(n, a.numel()):
            parts.entries[name] = new.detach().contiguous()
            parts.dense += 1
            continue
        parts.entries[name + IDX] = torch.frombuffer(bytearray(_pack_indices(idx)), dtype=torch.uint8)
        parts.entries[name + VAL] = new.detach().reshape(-1)[idx.to(new.device)]
    return parts


def assemble(
    parts: DeltaParts, *, base_version: int, target_version: int, base_sha256: str, target_sha256: str
) -> tuple[bytes | memoryview, DeltaStats]:
    """The delta's safetensors bytes: `parts` under the header naming both versions and digests."""
    from astraflow.weights.snapshot import state_dict_to_bytes

    meta = {
        "astraflow": MAGIC,
        "base_version": str(base_version),
        "target_version": str(target_version),
        "base_sha256": base_sha256,
        "target_sha256": target_sha256,
    }
    blob = state_dict_to_bytes(parts.entries, metadata=meta)
    return blob, DeltaStats(parts.elements, parts.changed, parts.dense, len(memoryview(blob)))


def encode_delta(
    base: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    *,
    base_version: int,
    target_version: int,
    base_sha256: str,
    target_sha256: str,
) -> tuple[bytes | memoryview, DeltaStats]:
    """The delta that turns `base` into `target` (same names, shapes and dtypes), as safetensors bytes."""
    return assemble(
        host_parts(base, target),
        base_version=base_version,
        target_version=target_version,
        base_sha256=base_sha256,
        target_sha256=target_sha256,
    )


def read_header(blob: bytes | memoryview) -> DeltaHeader:
    """The versions and digests a delta names (DeltaError when the blob is not a delta)."""
    meta = _metadata(blob)
    try:
        return DeltaHeader(
            int(meta["base_version"]),
            int(meta["target_version"]),
            meta["base_sha256"],
            meta["target_sha256"],
        )
    except (KeyError, ValueError) as exc:
        raise DeltaError(f"delta metadata lacks {exc}") from None


def _metadata(blob: bytes | memoryview) -> dict[str, str]:
    import json
    import struct

    view = memoryview(blob).cast("B")
    if len(view) < 8:
        raise DeltaError("not a delta: shorter than its header size")
    (hlen,) = struct.unpack_from("<Q", view, 0)
    if 8 + hlen > len(view) or hlen > 100 << 20:
        raise DeltaError("not a delta: header runs past the end")
    try:
        meta = json.loads(bytes(view[8 : 8 + hlen])).get("__metadata__", {})
    except (ValueError, AttributeError):
        raise DeltaError("not a delta: bad header") from None
    if not isinstance(meta, dict) or meta.get("astraflow") != MAGIC:
        raise DeltaError("not a delta of this format")
    return meta


def apply_delta(weights: dict[str, torch.Tensor], blob: bytes | memoryview) -> DeltaHeader:
    """Patch `weights` in place with a delta (they must be the delta's base).

    Every entry is checked before any tensor is written, so a delta that does not fit (names, dtypes,
    sizes, index range) raises DeltaError and leaves `weights` untouched. Whether the result is the
    target is for the caller to check against `header.target_sha256`.
    """
    from astraflow.weights.snapshot import bytes_to_state_dict

    header = read_header(blob)
    try:
        entries = bytes_to_state_dict(blob if isinstance(blob, bytes) else bytearray(blob))
    except ValueError as exc:
        raise DeltaError(f"bad delta: {exc}") from None
    plan: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
    for key, t in entries.items():
        if key.endswith(IDX):
            continue
        name = key[: -len(VAL)] if key.endswith(VAL) else key
        dst = weights.get(name)
        if dst is None:
            raise DeltaError(f"delta names {name!r}, which the weights lack")
        if t.dtype != dst.dtype:
            raise DeltaError(f"{name}: delta holds {t.dtype}, weights are {dst.dtype}")
        if key.endswith(VAL):
            packed = entries.get(name + IDX)
            if packed is None:
                raise DeltaError(f"{name}: values without a matching index stream")
            idx = _unpack_indices(packed.numpy().tobytes(), t.numel(), dst.numel())
            plan.append((dst, idx, t))
        elif t.shape != dst.shape:
            raise DeltaError(f"{name}: delta shape {list(t.shape)}, weights {list(dst.shape)}")
        else:
            plan.append((dst, None, t))
    for target, where, values in plan:
        if where is None:
            target.copy_(values)
        else:
            bits_of(target)[where.to(target.device)] = bits_of(values).to(target.device)
    return header

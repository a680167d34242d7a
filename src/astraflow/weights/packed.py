"""One version's weights as one packed byte buffer: a layout table (name, dtype, shape, byte offset)
and, per dtype, one contiguous region. Every fast transport (shared memory, CUDA IPC, broadcast)
moves this buffer whole; the receiver's tensors are views of it, so nothing is serialised."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 256
"""Each dtype region starts on this many bytes (CUDA's allocation alignment)."""
_DIGEST_WORDS = 1 << 24
"""int32 words summed per digest block: bounds the int64 temporary to 128 MB."""
_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives in the packed buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer."""
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The layout table of a packed buffer; equal layouts pack the same model the same way."""

    entries: tuple[Entry, ...]
    nbytes: int

    def to_json(self) -> bytes:
        """The table as compact JSON (what a transport sends once, not with every version)."""
        rows = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]
        return json.dumps({"nbytes": self.nbytes, "entries": rows}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Layout:
        """Parse and check a table: known dtypes, sizes that match shapes, entries inside the buffer."""
        doc = json.loads(raw)
        nbytes = int(doc["nbytes"])
        entries = []
        for name, dtype, shape, offset, size in doc["entries"]:
            if dtype not in _DTYPES:
                raise ValueError(f"layout entry {name!r}: unknown dtype {dtype!r}")
            numel = 1
            for d in shape:
                if int(d) < 0:
                    raise ValueError(f"layout entry {name!r}: negative dimension")
                numel *= int(d)
            item = torch.empty((), dtype=_DTYPES[dtype]).element_size()
            if int(size) != numel * item or not 0 <= int(offset) <= int(offset) + int(size) <= nbytes:
                raise ValueError(f"layout entry {name!r}: size or offset does not fit the buffer")
            entries.append(Entry(str(name), dtype, tuple(int(d) for d in shape), int(offset), int(size)))
        return cls(tuple(entries), nbytes)


def dtype_name(dtype: torch.dtype) -> str:
    """The layout's name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"cannot pack dtype {dtype}")
    return name


def plan(weights: dict[str, Any]) -> Layout:
    """The layout of a state dict: tensors grouped by dtype (one region each), then by name."""
    entries: list[Entry] = []
    offset = 0
    by_dtype: dict[str, list[str]] = {}
    for name in sorted(weights):
        by_dtype.setdefault(dtype_name(weights[name].dtype), []).append(name)
    for dtype in sorted(by_dtype):
        offset += -offset % ALIGN
        for name in by_dtype[dtype]:
            t = weights[name]
            n = t.numel() * t.element_size()
            entries.append(Entry(name, dtype, tuple(t.shape), offset, n))
            offset += n
    return Layout(tuple(entries), offset)


def pack(weights: dict[str, Any], layout: Layout, buf: torch.Tensor) -> None:
    """Copy every tensor into its place in `buf` (uint8, any device): one copy per tensor, no host trip
    when `buf` is on the tensors' device; the alignment gaps are zeroed, so equal weights pack to equal
    bytes (and digests)."""
    end = 0
    with torch.no_grad():
        for e in layout.entries:
            if e.offset > end:
                buf[end : e.offset].zero_()
            end = max(end, e.offset + e.nbytes)
            if e.nbytes:
                src = weights[e.name].detach().contiguous().reshape(-1).view(torch.uint8)
                buf[e.offset : e.offset + e.nbytes].copy_(src, non_blocking=True)


def views(buf: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors of a packed buffer, as views of it (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for e in layout.entries:
        dtype = _DTYPES[e.dtype]
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=dtype, device=buf.device)
        else:
            out[e.name] = buf[e.offset : e.offset + e.nbytes].view(dtype).reshape(e.shape)
    return out


def digest(buf: torch.Tensor) -> str:
    """A fast checksum of a packed buffer, computed where the buffer lives (on the GPU for a device
    buffer): per block of int32 words, the block's sum; then those sums plain and position-weighted.
    It catches torn reads, truncation and corruption; it is not a cryptographic hash (the ZeroMQ path
    keeps sha256)."""
    n = buf.numel()
    words = buf[: n - n % 4].view(torch.int32)
    tail = int(buf[n - n % 4 :].to(torch.int64).sum().item()) if n % 4 else 0
    if words.numel() == 0:
        return f"f1:{n}:{tail}:0"
    sums = torch.stack(
        [blk.to(torch.int64).sum() for blk in torch.split(words, _DIGEST_WORDS)]
    )  # one device->host transfer below, not one per block
    weights = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    both = torch.stack([sums.sum(), (sums * weights).sum()]).tolist()
    return f"f1:{n}:{both[0] + tail}:{both[1]}"

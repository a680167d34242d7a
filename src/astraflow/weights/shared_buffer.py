"""Same-host weight hand-over: the trainer packs each version into one of a few slots (double
buffering) and a worker on the same host maps the slot and reads it in place.

A slot is a file in /dev/shm (mode 0600) holding a small header, the layout table and, on a CPU, the
packed bytes; on a GPU the bytes live in one device buffer of the trainer whose CUDA IPC handle
travels in the announcement. The file is also the slot's lock:

- the trainer takes an exclusive `flock` (non-blocking) to overwrite a slot, and skips a slot a
  reader still holds (it then offers this version on the other paths only: it never waits);
- a reader takes a shared `flock`, checks the header names the announced version, and holds the
  lock until its engine has copied the weights (`Received.release`).

So a version's bytes are never overwritten while an engine may still read them; a reader that dies
loses its lock with its file descriptors, so it cannot block the trainer.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from astraflow import log
from astraflow.errors import WeightIntegrityError
from astraflow.weights import packed

if TYPE_CHECKING:
    from astraflow.weights.slot_ref import SlotRef

_log = log.get("weights.shared")
SHM_DIR = Path(os.environ.get("ASTRAFLOW_SHM_DIR", "/dev/shm"))
_MAGIC = b"AFWPACK1"
_HEAD = struct.Struct("<8sqqqq")
"""magic, version (-1 while being written), layout bytes, data offset, data bytes."""
_DIGEST_BYTES = 64
DATA_ALIGN = 4096
LOCK_WAIT_S = 5.0
"""How long a reader waits for a slot the trainer is writing (it writes for milliseconds)."""


class StaleOfferError(WeightIntegrityError):
    """The slot was already reused for a newer version: take the newer one or another path."""


def host_id() -> str:
    """This host's identity as offers carry it: host name and boot id (a reboot changes it)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class IpcHandle(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A CUDA IPC handle of a packed device buffer (torch's storage sharing fields)."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool
    numel: int
    device_uuid: str = ""
    """The GPU's UUID (device indices differ between processes with other CUDA_VISIBLE_DEVICES)."""


@dataclass
class _Slot:
    path: Path
    fd: int
    mapping: mmap.mmap
    data: torch.Tensor
    """The packed bytes: a view of the file on a CPU, a device buffer on a GPU."""
    ipc: bytes = b""
    version: int = -1


@dataclass
class Export:
    """What the trainer announces for one version on this path."""

    kind: str
    """"shm" (bytes in the file) or "cuda_ipc" (bytes on the trainer's GPU)."""
    path: str
    ipc: bytes
    digest: str


class SharedExporter:
    """The trainer's side: `slots` packed buffers reused in turn."""

    def __init__(self, policy: str, device: torch.device, slots: int = 2) -> None:
        """Slots are created on the first publish (the layout gives their size)."""
        self.policy = policy
        self.device = device
        self.n_slots = slots
        self.layout: packed.Layout | None = None
        self._slots: list[_Slot] = []
        self._tag = f"astraflow-{os.getpid()}-{secrets.token_hex(8)}"
        sweep_dead_slots()

    @property
    def kind(self) -> str:
        """The offer kind this exporter produces."""
        return "cuda_ipc" if self.device.type == "cuda" else "shm"

    def publish(self, version: int, weights: dict[str, Any]) -> Export | None:
        """Pack `version` into a free slot; None when every slot is still being read (never waits)."""
        layout = packed.plan(weights)
        if self.layout is None:
            self.layout = layout
            self._slots = [self._create(i, layout) for i in range(self.n_slots)]
        elif layout != self.layout:
            raise ValueError("the model's layout changed between versions")
        for slot in sorted(self._slots, key=lambda s: s.version):
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                self._write_version(slot, -1, "")
                packed.pack(weights, layout, slot.data)
                if slot.data.is_cuda:
                    # this stream's copies only: a device-wide sync would also wait for the blob's
                    # host copy of the version before (a side stream) and the next step's kernels
                    torch.cuda.current_stream(slot.data.device).synchronize()
                digest = packed.digest(slot.data)
                self._write_version(slot, version, digest)
                slot.version = version
            finally:
                fcntl.flock(slot.fd, fcntl.LOCK_UN)
            return Export(self.kind, str(slot.path), slot.ipc, digest)
        _log.warning(
            "%s version %d: every shared slot is being read; offered on the other paths", self.policy, version
        )
        return None

    def close(self) -> None:
        """Remove the slot files (readers that mapped them keep their mapping until they let go)."""
        for slot in self._slots:
            try:
                slot.path.unlink()
            except FileNotFoundError:
                pass
            os.close(slot.fd)
        self._slots = []

    def _create(self, index: int, layout: packed.Layout) -> _Slot:
        table = layout.to_json()
        data_off = _HEAD.size + _DIGEST_BYTES + len(table)
        data_off += -data_off % DATA_ALIGN
        in_file = layout.nbytes if self.device.type != "cuda" else 0
        path = SHM_DIR / f"{self._tag}-{self.policy}-{index}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, data_off + max(in_file, 1))
        mapping = mmap.mmap(fd, data_off + max(in_file, 1))
        _HEAD.pack_into(mapping, 0, _MAGIC, -1, len(table), data_off, layout.nbytes)
        mapping[_HEAD.size + _DIGEST_BYTES : _HEAD.size + _DIGEST_BYTES + len(table)] = table
        if self.device.type == "cuda":
            data = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            ipc = msgspec.msgpack.encode(_share_cuda(data))
        else:
            data = torch.frombuffer(mapping, dtype=torch.uint8, count=layout.nbytes, offset=data_off)
            ipc = b""
        return _Slot(path, fd, mapping, data, ipc)

    @staticmethod
    def _write_version(slot: _Slot, version: int, digest: str) -> None:
        raw = digest.encode()[:_DIGEST_BYTES].ljust(_DIGEST_BYTES, b"\0")
        slot.mapping[_HEAD.size : _HEAD.size + _DIGEST_BYTES] = raw
        struct.pack_into("<q", slot.mapping, 8, version)


def sweep_dead_slots() -> None:
    """Remove slot files of trainers that died without closing them (killed: tmpfs keeps them)."""
    for f in SHM_DIR.glob("astraflow-*-*"):
        pid = f.name.split("-")[1]
        try:
            if not pid.isdigit() or f.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)
        except OSError:
            pass  # gone already, or alive under another user


@dataclass
class Received:
    """A version's tensors as views of a shared slot, readable until `release`."""

    version: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    _fd: int = -1
    _keep: list[Any] = field(default_factory=list)
    _on_release: Callable[[], None] | None = None
    """Hands a lent receive buffer back (the ZeroMQ pull's)."""
    slot: SlotRef | None = None
    """The slot this version was mapped from (same-host paths): an engine that maps slots itself is
    handed this instead of `tensors` (weights/slot_ref.py)."""

    @property
    def lent(self) -> bool:
        """The tensors view a buffer that is only lent: `release` it once the engine copied them."""
        return self._fd >= 0 or self._on_release is not None

    def release(self) -> None:
        """Let the trainer reuse the slot (or the puller its buffer): call once the engine no longer
        reads the tensors."""
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
        if self._on_release is not None:
            give, self._on_release = self._on_release, None
            give()


class SharedImporter:
    """A worker's side: maps slots (once each) and checks every version before handing it out."""

    def __init__(self, device: torch.device) -> None:
        """Device tensors are read from where the engine runs (the IPC mapping opens there)."""
        self.device = device
        self._maps: dict[tuple[str, bytes], tuple[torch.Tensor, packed.Layout, mmap.mmap, bytes]] = {}

    def receive(self, kind: str, path: str, ipc: bytes, version: int, expect_digest: str) -> Received:
        """Lock, check and map one announced version; StaleOfferError when the slot moved on,
        WeightIntegrityError when its bytes do not match the announced digest."""
        fd = os.open(path, os.O_RDONLY)
        try:
            _lock_shared(fd)
            key = (path, ipc)
            if key not in self._maps:
                self._maps[key] = self._map(path, kind, ipc)
            data, layout, mapping, table = self._maps[key]
            _magic, have, _t, _o, _n = _HEAD.unpack_from(mapping, 0)
            if have != version:
                raise StaleOfferError(f"shared slot {path} holds version {have}, not {version}", hint="")
            got = packed.digest(data)
            if got != expect_digest:
                raise WeightIntegrityError(
                    f"shared slot {path} version {version}: digest {got} != announced {expect_digest}",
                    hint="the slot's bytes are not what the trainer announced; pulling over ZeroMQ instead",
                )
            from astraflow.weights.slot_ref import SlotRef

            ref = SlotRef(kind, path, ipc, version, expect_digest, table)
            out = Received(version, packed.views(data, layout), layout.nbytes, fd, slot=ref)
            fd = -1
            return out
        finally:
            if fd >= 0:
                os.close(fd)

    def _map(self, path: str, kind: str, ipc: bytes) -> tuple[torch.Tensor, packed.Layout, mmap.mmap, bytes]:
        # a descriptor of its own: mmap keeps a duplicate of it, which must not share the lock's
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, _v, tlen, data_off, nbytes = _HEAD.unpack_from(mapping, 0)
        if magic != _MAGIC:
            raise WeightIntegrityError("not an astraflow weight slot", hint="")
        start = _HEAD.size + _DIGEST_BYTES
        table = bytes(mapping[start : start + tlen])
        layout = packed.Layout.from_json(table)
        if layout.nbytes != nbytes:
            raise WeightIntegrityError("weight slot header and layout disagree", hint="")
        if kind == "cuda_ipc":
            data = _open_cuda(msgspec.msgpack.decode(ipc, type=IpcHandle), self.device)
        else:
            if data_off + nbytes > size:
                raise WeightIntegrityError("weight slot shorter than its layout", hint="")
            with warnings.catch_warnings():
                # a read-only mapping: torch warns that it is not writable; the views are only read
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(memoryview(mapping), dtype=torch.uint8, count=nbytes, offset=data_off)
        return data, layout, mapping, table


def _lock_shared(fd: int) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StaleOfferError("the trainer kept the shared slot locked", hint="") from None
            time.sleep(0.001)


def _share_cuda(buf: torch.Tensor) -> IpcHandle:
    """The IPC handle of a device buffer (CUDA only; the GPU bench and gpu tests run it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _fn, args = reduce_tensor(buf)
    # (cls, size, stride, offset, storage cls, dtype, device, handle, storage bytes, storage offset,
    #  requires_grad, ref counter handle, ref counter offset, event handle, event sync required)
    device, handle, sbytes, soff = args[6:10]
    ref_h, ref_off, ev_h, ev_sync = args[11:15]
    return IpcHandle(
        int(device),
        bytes(handle),
        int(sbytes),
        int(soff),
        bytes(ref_h),
        int(ref_off),
        bytes(ev_h or b""),
        bool(ev_sync),
        buf.numel(),
        str(torch.cuda.get_device_properties(int(device)).uuid),
    )


def rebuild_args(
    h: IpcHandle,
    dtype: torch.dtype,
    device: int | str,
    shape: tuple[int, ...] | None = None,
    offset: int = 0,
) -> tuple[Any, ...]:
    """The arguments of torch's `rebuild_cuda_tensor` that map `h`'s buffer in another process: the
    whole buffer as bytes (no `shape`), or a contiguous `dtype` view of `shape` starting `offset`
    elements in. `device` is this process's GPU index, or the GPU's UUID for a receiver that maps it
    to its own index (SGLang's patched rebuild)."""
    size = torch.Size(shape if shape is not None else (h.numel,))
    return (
        torch.Tensor,
        size,
        contiguous_stride(size),
        offset,
        torch.storage.TypedStorage,
        dtype,
        device,
        h.handle,
        h.storage_bytes,
        h.storage_offset,
        False,
        h.ref_handle,
        h.ref_offset,
        h.event_handle or None,
        h.event_sync,
    )


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of `shape`."""
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _open_cuda(h: IpcHandle, device: torch.device) -> torch.Tensor:
    """Map another process's packed device buffer into this one (CUDA only)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        return rebuild_cuda_tensor(*rebuild_args(h, torch.uint8, index))

"""Cross-host weight broadcast over torch.distributed (NCCL on GPUs, gloo on CPUs).

The trainer runs a `BroadcastHub`: a TCPStore it owns and, per *generation*, one process group of
itself (rank 0) and the workers that joined. Workers are elastic, so membership is by generation:

- a worker that wants the broadcast registers in the store (under the group's secret prefix, which it
  got through the authenticated control plane) and waits for its rank in the next generation;
- when joiners are waiting, the hub tells the current group to regroup, opens generation g+1 with the
  old members and the joiners, and broadcasts the current version again (a late joiner gets it);
- every collective has a timeout; when one fails (a worker died mid-broadcast), the hub drops that
  generation and its members register again;
- no collective waits while nothing is sent: before each message the hub rings a bell in the store
  (one key per message of a generation) and only then do the members post their receives. A receive
  left posted between versions would hold its stream and, on a GPU, a spinning kernel; a member whose
  hub is gone learns it from the store. An idle hub sends a short keepalive (rung the same way) every
  third of the collective timeout, so a member that died between versions is found by a failed send. The trainer's thread never waits on any of it: `publish`
  only hands the newest version to the hub's thread, which skips versions it had no time to send.

Each version is one packed buffer (weights/packed.py), sent in buckets, preceded by a small header
(operation, version, size) and the digest; the worker checks the digest against the one the control
plane announced before anything is applied. NCCL and gloo authenticate nothing: see docs/protocol.md.

Over 400 lines because the hub and the member speak one protocol over the store (generations,
bells, regroups), which reads best side by side.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from astraflow import log
from astraflow.weights import packed

_log = log.get("weights.broadcast")
_VERSION, _KEEPALIVE, _REGROUP = 1, 2, 3
_DROPPED = "dropped"
_HEADER = 4
_DIGEST = 64
_SEAL = 0x5EA1ED
"""What a message's seal carries, with the number of its chunks (`_bcast_all`)."""
JOIN_POLL_S = 0.5
"""How often the hub's thread looks for joiners between versions."""


@dataclass
class Payload:
    """One packed version."""

    version: int
    buf: torch.Tensor
    digest: str
    ready: Any = None
    """A CUDA event after the kernels that wrote `buf` (None on a CPU)."""


def _side_stream(device: torch.device) -> Any:
    """A stream of the broadcast thread's own (None on a CPU).

    NCCL's `Work.wait()` makes the *current* stream wait for the collective. On the default stream,
    a receive posted for the next header would hold every kernel the process queues after it (an
    engine's decoding, a digest) until the trainer sends again; on a stream of its own it holds
    nothing but the broadcast."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _on(stream: Any) -> Any:
    import contextlib

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _group(store: Any, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(prefix, store)
    if device.type == "cuda":  # pragma: no cover - needs GPUs
        import os

        # a timed-out collective must fail in its wait, not tear the trainer's process down (the default);
        # and at once: on a timeout the watchdog signals a debug dump and waits for it (a minute by
        # default) before it fails the work, and the survivors' waits with it
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
        os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "100")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(scoped, rank, size, opts)
    return dist.ProcessGroupGloo(scoped, rank, size, timeout)


def _bcast(pg: Any, t: torch.Tensor, timeout_s: float) -> None:
    """Broadcast `t` from rank 0 and wait until it is done (see `_bcast_all`)."""
    _bcast_all(pg, [t], timeout_s)


def _bcast_all(pg: Any, chunks: list[torch.Tensor], timeout_s: float) -> None:
    """Broadcast each chunk from rank 0, in order, and wait until all are done; raises when one fails,
    was cut short, or they outlast `timeout_s` (a member died or hung).

    gloo's `wait` blocks and raises by itself. NCCL's only makes the current stream wait, so the
    calling thread would go on (the hub to its next message, into a group whose member is gone; a
    member into a sync that never returns): on a GPU the thread polls the last collective's work (NCCL
    runs one group's collectives in order) until it completes — NCCL's watchdog marks a timed-out
    collective failed — and, should even that not come, aborts the group.

    A collective that an abort ended counts as completed on NCCL and its `wait` does not raise, so a
    member would take torn bytes for a received version (found on GPUs: a survivor of a member killed
    mid-version handed that version on). So the chunks are followed by a seal, a small tensor rank 0
    sends with known values: a member whose seal did not arrive intact got a cut-short message and
    raises. (The work's own `exception()` cannot be read: torch 2.11's binding fails to convert it.)"""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    device = chunks[-1].device if chunks else torch.device("cpu")
    expected = torch.tensor([_SEAL, len(chunks)], dtype=torch.int64)
    seal = expected.to(device) if pg.rank() == 0 else torch.zeros(2, dtype=torch.int64, device=device)
    works = [pg.broadcast([t], opts) for t in [*chunks, seal]]
    if device.type == "cuda":
        deadline = time.monotonic() + timeout_s * 1.5 + 1.0
        pause = 0.0002
        while not works[-1].is_completed():
            if time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    pg.abort()
                raise TimeoutError(
                    f"a broadcast did not complete in {timeout_s:.0f} s (a member died or hung)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
    for work in works:
        work.wait()
    if not torch.equal(seal.cpu(), expected):
        raise RuntimeError("a broadcast was cut short (its seal did not arrive): the group was aborted")


def _send_header(
    pg: Any,
    device: torch.device,
    timeout_s: float,
    op: int,
    version: int,
    nbytes: int,
    arg: int,
    digest: str = "",
) -> None:
    head = torch.tensor([op, version, nbytes, arg], dtype=torch.int64, device=device)
    _bcast(pg, head, timeout_s)
    if op == _VERSION:
        raw = torch.zeros(_DIGEST, dtype=torch.uint8)
        enc = digest.encode()[:_DIGEST]
        raw[: len(enc)] = torch.tensor(list(enc), dtype=torch.uint8)
        _bcast(pg, raw.to(device), timeout_s)


class BroadcastHub:
    """The trainer's side of the broadcast: owns the store, the generations and a sender thread."""

    def __init__(
        self,
        bind_host: str,
        advertise_host: str,
        device: torch.device,
        *,
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 30.0,
    ) -> None:
        """Start the store (a free port) and the sender thread."""
        import torch.distributed as dist

        self.device = device
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            bind_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.address = f"{advertise_host}:{self.store.port}"
        self.token = secrets.token_hex(16)
        """The secret prefix of every store key: only members given it by the control plane can join."""
        self.generation = 0
        self.members: list[str] = []
        self.sent: dict[int, int] = {}
        """Version -> workers it reached (for the bench and the logs)."""
        self._seen_joins = 0
        self._bell = 0
        """The next message's number in the current generation."""
        self._pg: Any = None
        self._latest: Payload | None = None
        self._pending = False
        self._layout_set = False
        self._cond = threading.Condition()
        self._closed = False
        self._stream = _side_stream(device)
        self._thread = threading.Thread(target=self._run, name="astraflow-broadcast", daemon=True)
        self._thread.start()

    def publish(self, version: int, weights: dict[str, Any]) -> str:
        """Pack `version` (on the hub's device) and queue it for the sender thread; returns its digest
        ("" while no worker ever joined: nothing is packed, and the first joiners get the next version)."""
        if not self.generation and int(self.store.add(f"{self.token}/njoin", 0)) <= self._seen_joins:
            return ""
        layout = packed.plan(weights)
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        packed.pack(weights, layout, buf)
        digest = packed.digest(buf)
        ready = None
        if buf.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        if not self._layout_set:
            self.store.set(f"{self.token}/bucket", str(self.bucket_bytes))
            self.store.set(f"{self.token}/layout", layout.to_json().decode())
            self._layout_set = True
        with self._cond:
            self._latest = Payload(version, buf, digest, ready)
            self._pending = True
            self._cond.notify()
        return digest

    def close(self) -> None:
        """Stop sending; the members see their group fail and fall back to other paths."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(self.timeout_s + 5)
        self._pg = None

    def _run(self) -> None:
        with _on(self._stream):
            self._loop()

    def _loop(self) -> None:
        keepalive_at = time.monotonic() + self.timeout_s / 3
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending, timeout=JOIN_POLL_S)
                if self._closed:
                    return
                payload, send = self._latest, self._pending
                self._pending = False
            try:
                joined = self._regroup_if_joined(payload is not None)
                if self._pg is not None and payload is not None and (send or joined):
                    self._send(payload)
                elif self._pg is not None and time.monotonic() >= keepalive_at:
                    # a short message now and then finds a member that died between versions (its
                    # send fails) so the generation is dropped before a version waits on it
                    self._ring()
                    _send_header(self._pg, self.device, self.timeout_s, _KEEPALIVE, -1, 0, self.generation)
                else:
                    continue
                keepalive_at = time.monotonic() + self.timeout_s / 3
            except Exception as exc:  # a member died or hung: drop the generation, members re-register
                _log.warning(
                    "broadcast generation %d failed (%s); members must join again", self.generation, exc
                )
                self._pg = None
                self.members = []
                with contextlib.suppress(Exception):
                    self._ring(_DROPPED)  # members waiting for the next message register again

    def _ring(self, what: str = "1") -> None:
        """Tell the generation's members that a message follows (they post their receives now), or
        that the generation is dropped."""
        self.store.set(f"{self.token}/g{self.generation}/bell/{self._bell}", what)
        self._bell += 1

    def _joiners(self) -> list[str]:
        count = int(self.store.add(f"{self.token}/njoin", 0))
        out = []
        for i in range(self._seen_joins + 1, count + 1):
            out.append(self.store.get(f"{self.token}/join/{i}").decode())
        self._seen_joins = count
        return out

    def _regroup_if_joined(self, have_layout: bool) -> bool:
        if not have_layout:
            return False  # joiners wait for the first packed version (it writes the layout)
        joiners = self._joiners()
        if not joiners:
            return False
        g = self.generation + 1
        if self._pg is not None:
            try:
                self._ring()
                _send_header(self._pg, self.device, self.timeout_s, _REGROUP, -1, 0, g)
            except Exception as exc:  # a member died: the joiners (already counted) must not wait on
                _log.warning(
                    "broadcast generation %d failed (%s); its members join again", self.generation, exc
                )
                with contextlib.suppress(Exception):
                    self._ring(_DROPPED)
                self.members = []
        tickets = self.members + joiners
        self.store.set(f"{self.token}/g{g}/members", json.dumps(tickets))
        for t in joiners:
            self.store.set(f"{self.token}/assign/{t}", str(g))
        self.generation, self._pg, self._bell = g, None, 0
        # members keep their tickets ("member#join number") across generations
        self.members = tickets
        self._pg = _group(self.store, f"{self.token}/g{g}/", 0, len(tickets) + 1, self.device, self.timeout_s)
        _log.info("broadcast generation %d: %d members", g, len(tickets))
        return True

    def _send(self, p: Payload) -> None:
        n = p.buf.numel()
        if p.ready is not None:
            torch.cuda.current_stream(p.buf.device).wait_event(p.ready)  # the packing is done
        self._ring()
        _send_header(self._pg, self.device, self.timeout_s, _VERSION, p.version, n, self.generation, p.digest)
        buckets = [p.buf[start : start + self.bucket_bytes] for start in range(0, n, self.bucket_bytes)]
        _bcast_all(self._pg, buckets, self.timeout_s)
        self.sent[p.version] = len(self.members)


class BroadcastMember:
    """A worker's side: joins the hub's groups on a thread and keeps the newest version received."""

    def __init__(
        self, address: str, token: str, member_id: str, device: torch.device, *, timeout_s: float = 30.0
    ) -> None:
        """Register with the hub at `address` (host:port) under `token`; returns at once."""
        self.address, self.token, self.member_id = address, token, member_id
        self.device = device
        self.timeout_s = timeout_s
        self.latest: Payload | None = None
        self.layout: packed.Layout | None = None
        self.error = ""
        self._bucket_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._stream = _side_stream(device)
        self._inflight: torch.Tensor | None = None
        self._quarantine: list[torch.Tensor] = []
        self._thread = threading.Thread(target=self._run, name="astraflow-broadcast-member", daemon=True)
        self._thread.start()

    def wait_for(self, version: int, timeout_s: float) -> Payload | None:
        """The received payload of `version` (or newer), or None after `timeout_s`."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or (self.latest is not None and self.latest.version >= version),
                timeout_s,
            )
            return self.latest if self.latest is not None and self.latest.version >= version else None

    def close(self) -> None:
        """Stop receiving (the thread exits at its next timeout or failure)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        """Whether the receiving thread still runs."""
        return self._thread.is_alive()

    def _run(self) -> None:
        with _on(self._stream):
            self._serve()

    def _serve(self) -> None:
        import torch.distributed as dist

        host, _, port = self.address.rpartition(":")
        try:
            store = dist.TCPStore(
                host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s)
            )
        except Exception as exc:
            self.error = f"cannot reach the broadcast store at {self.address}: {exc}"
            _log.warning("%s", self.error)
            return
        while not self._closed:
            try:
                self._session(store)
            except Exception as exc:  # the generation failed or timed out: register again
                self.error = str(exc)[:500]
                if self._inflight is not None:
                    # the buffers of the last two versions cut short stay allocated: an aborted
                    # group's transfers may still be landing in them
                    self._quarantine = [*self._quarantine[-1:], self._inflight]
                    self._inflight = None
                try:
                    store.add(f"{self.token}/njoin", 0)
                except Exception:  # noqa: BLE001 - the hub is gone (its trainer stopped): leave
                    _log.info("broadcast store at %s gone; leaving", self.address)
                    return
                _log.info("broadcast group left (%s); joining again", self.error)
                time.sleep(0.05)

    def _session(self, store: Any) -> None:
        n = int(store.add(f"{self.token}/njoin", 1))
        ticket = f"{self.member_id}#{n}"
        store.set(f"{self.token}/join/{n}", ticket)
        key = f"{self.token}/assign/{ticket}"
        while not self._closed:
            try:
                store.wait([key], datetime.timedelta(seconds=1))
                break
            except Exception:  # noqa: BLE001 - a timeout: check whether we are closed, then wait on
                continue
        if self._closed:
            return
        g = int(store.get(key))
        _log.info("broadcast: %s joins generation %d", ticket, g)
        while not self._closed:
            tickets = json.loads(store.get(f"{self.token}/g{g}/members"))
            rank = tickets.index(ticket) + 1
            if self.layout is None:
                self.layout = packed.Layout.from_json(store.get(f"{self.token}/layout"))
                self._bucket_bytes = int(store.get(f"{self.token}/bucket"))
            pg = _group(store, f"{self.token}/g{g}/", rank, len(tickets) + 1, self.device, self.timeout_s)
            g = self._receive(store, g, pg)
            if g < 0:
                return

    def _bell(self, store: Any, key: str) -> bool:
        """Wait for the hub's bell `key` (False once closed); raises when the hub dropped the
        generation or its store is gone."""
        while not self._closed:
            try:
                store.wait([key], datetime.timedelta(seconds=1))
            except Exception:  # noqa: BLE001 - a timeout, or the store is gone: tell them apart
                store.add(f"{self.token}/njoin", 0)  # raises when the hub is gone
                continue
            if store.get(key).decode() == _DROPPED:
                raise RuntimeError("the hub dropped this generation")
            return True
        return False

    def _receive(self, store: Any, g: int, pg: Any) -> int:
        """Receive versions until the hub regroups (returns the next generation) or we close (-1)."""
        bell = 0
        while self._bell(store, f"{self.token}/g{g}/bell/{bell}"):
            bell += 1
            head = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            _bcast(pg, head, self.timeout_s)
            op, version, nbytes, arg = (int(x) for x in head.tolist())
            if op == _REGROUP:
                return arg
            if op != _VERSION:
                continue
            raw = torch.zeros(_DIGEST, dtype=torch.uint8, device=self.device)
            _bcast(pg, raw, self.timeout_s)
            digest = bytes(raw.cpu().tolist()).rstrip(b"\0").decode()
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            bucket = max(1, self._bucket_bytes)
            self._inflight = buf
            _bcast_all(
                pg, [buf[start : start + bucket] for start in range(0, nbytes, bucket)], self.timeout_s
            )
            self._inflight = None
            if self._stream is not None:
                self._stream.synchronize()  # whole before a reader on another stream sees it
            _log.info("broadcast: version %d received in generation %d as rank %d", version, g, pg.rank())
            with self._cond:
                self.latest = Payload(version, buf, digest)
                self._cond.notify_all()
        return -1

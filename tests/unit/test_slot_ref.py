"""Versions handed to an engine as a reference to their same-host slot (weights/slot_ref.py): the RaaS
gives an engine that takes slots only the reference, the engine maps and checks the real /dev/shm slot
itself; an engine that declines gets tensors; a slot whose bytes or layout changed is refused where it
is mapped and the old weights stay."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from typing import Any

import pytest

from astraflow.errors import WeightIntegrityError, WeightsMismatchError
from astraflow.protocol.messages import VersionInfo

torch = pytest.importorskip("torch")


class SlotEngine:
    """An engine stand-in that maps slots itself, as the vLLM plugin's worker does: it checks the
    layout against its parameters when given the reference, then reads the slot on its own thread
    through its own importer (so every check runs again there) and copies from it."""

    def __init__(self, params: dict[str, Any], takes_slots: bool = True) -> None:
        from astraflow.weights.shared_buffer import SharedImporter

        self.params = {k: v.clone() for k, v in params.items()}
        self.takes_slots = takes_slots
        self.version = 0
        self.got: list[str] = []
        """What each update came as: "slot" or "tensors"."""
        self.error = ""
        self.refused = -1
        self.before_read: Any = None
        """Called with the slot's path just before the engine reads it (a test corrupts it there)."""
        self._importer = SharedImporter(torch.device("cpu"))
        self._applied = threading.Condition()

    def load_weights(self, version: int, sd: dict[str, Any]) -> None:
        from astraflow.engines.weights import check_weights

        self.got.append("tensors")
        self._apply(version, check_weights(self.params, sd))

    def load_slot(self, version: int, slot: Any) -> bool:
        from astraflow.engines.weights import check_weights
        from astraflow.weights.slot_ref import SlotRef, layout_meta, read_slot

        if not self.takes_slots:
            return False
        self.got.append("slot")
        check_weights(self.params, layout_meta(slot))
        raw = slot.encode()  # what would cross an engine's own RPC

        def read() -> None:
            if self.before_read is not None:
                self.before_read(slot.path)
            try:
                got = read_slot(SlotRef.decode(raw), self._importer)
            except WeightIntegrityError as exc:
                with self._applied:
                    self.error = str(exc)
                    self.refused = version
                    self._applied.notify_all()
                return
            try:
                self._apply(version, got.tensors, thread=False)
            finally:
                got.release()

        threading.Thread(target=read).start()
        return True

    def _apply(self, version: int, tensors: dict[str, Any], thread: bool = True) -> None:
        def apply() -> None:
            for k, v in tensors.items():
                self.params[k].copy_(v)
            with self._applied:
                self.version = version
                self._applied.notify_all()

        threading.Thread(target=apply).start() if thread else apply()

    def slot_refused(self, version: int) -> bool:
        return self.refused >= version > self.version

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        with self._applied:
            return self._applied.wait_for(lambda: self.version >= version, timeout)

    def wait_error(self, timeout: float) -> str:
        with self._applied:
            self._applied.wait_for(lambda: bool(self.error), timeout)
            return self.error


OLD = {"w": torch.zeros(64, 64), "b": torch.zeros(64, dtype=torch.bfloat16)}


def _scaled(k: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), k), "b": torch.full((64,), k, dtype=torch.bfloat16)}


def _sync(engine: Any) -> Any:
    from astraflow.metrics.role_stats import PullStats
    from astraflow.roles.weight_sync import WeightSync
    from astraflow.weights.transport import SharedTransport

    return WeightSync({"p": engine}, {"shm": SharedTransport(torch.device("cpu"))}, ["ipc"], PullStats())


async def _deliver(sync: Any, version: int, offer: Any) -> None:
    sync.poll({"p": VersionInfo(policy="p", version=version, weights_addr="", offers=[offer])})
    await sync.until_settled(30.0)


async def _publish(trainer: Any, version: int, weights: dict[str, Any]) -> Any:
    """Publish into a free slot; a slot is freed by the RaaS's release thread once the engine applied
    its version, so wait (bounded) for that instead of assuming it already ran."""
    deadline = asyncio.get_running_loop().time() + 20.0
    while (offer := trainer.publish(version, weights)) is None:
        assert asyncio.get_running_loop().time() < deadline, "no slot was released"
        await asyncio.sleep(0.01)
    return offer


def _corrupt(path: str) -> None:
    """Flip one byte of a slot's packed bytes (the header says where they start)."""
    fd = os.open(path, os.O_RDWR)
    try:
        data_off = struct.unpack_from("<q", os.pread(fd, 40, 0), 24)[0]
        b = os.pread(fd, 1, data_off + 7)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), data_off + 7)
    finally:
        os.close(fd)


def test_an_engine_that_takes_slots_gets_only_the_reference() -> None:
    from astraflow.weights.transport import SharedTransport

    trainer = SharedTransport(torch.device("cpu"), policy="p")
    engine = SlotEngine(OLD)

    async def scenario() -> None:
        sync = _sync(engine)
        offer = trainer.publish(1, _scaled(1.0))
        assert offer is not None
        await _deliver(sync, 1, offer)
        assert engine.got == ["slot"] and engine.version == 1
        assert torch.equal(engine.params["w"], _scaled(1.0)["w"])
        assert torch.equal(engine.params["b"], _scaled(1.0)["b"])
        # the RaaS's lock on the slot goes once the engine applied it: the trainer fills both slots again
        for v in (2, 3):
            await _deliver(sync, v, await _publish(trainer, v, _scaled(float(v))))
        assert engine.version == 3 and engine.got == ["slot"] * 3
        assert torch.equal(engine.params["w"], _scaled(3.0)["w"])

    try:
        asyncio.run(scenario())
    finally:
        trainer.close()


def test_an_engine_that_declines_gets_tensors() -> None:
    from astraflow.weights.transport import SharedTransport

    trainer = SharedTransport(torch.device("cpu"), policy="p")
    engine = SlotEngine(OLD, takes_slots=False)
    try:
        offer = trainer.publish(1, _scaled(2.0))
        assert offer is not None
        asyncio.run(_deliver(_sync(engine), 1, offer))
        assert engine.got == ["tensors"] and engine.version == 1
        assert torch.equal(engine.params["w"], _scaled(2.0)["w"])
    finally:
        trainer.close()


def test_the_reference_is_small_and_checked_where_it_is_mapped() -> None:
    from astraflow.weights.shared_buffer import SharedImporter
    from astraflow.weights.slot_ref import SlotRef, layout_meta, read_slot
    from astraflow.weights.transport import SharedTransport

    big = {"w": torch.randn(512, 512), "b": torch.randn(512, dtype=torch.bfloat16)}
    trainer = SharedTransport(torch.device("cpu"), policy="p")
    raas = SharedTransport(torch.device("cpu"))
    try:
        offer = trainer.publish(1, big)
        assert offer is not None
        got = raas.receive(VersionInfo(policy="p", version=1, weights_addr="", offers=[offer]), offer)
        ref = got.slot
        assert ref is not None and ref.version == 1 and ref.digest == offer.digest
        raw = ref.encode()
        assert len(raw) < 2048 < got.nbytes // 100  # the reference, not the bytes
        assert SlotRef.decode(raw) == ref
        meta = layout_meta(ref)
        assert {k: (tuple(t.shape), t.dtype) for k, t in meta.items()} == {
            k: (tuple(t.shape), t.dtype) for k, t in big.items()
        }
        with pytest.raises(WeightsMismatchError):  # checked from the layout alone, before any copy
            from astraflow.engines.weights import check_weights

            check_weights({"w": torch.zeros(4, 4)}, meta)
        engine_side = SharedImporter(torch.device("cpu"))
        mapped = read_slot(SlotRef.decode(raw), engine_side)
        assert torch.equal(mapped.tensors["w"], big["w"]) and torch.equal(mapped.tensors["b"], big["b"])
        mapped.release()
        other = SlotRef(
            ref.kind, ref.path, ref.ipc, ref.version, ref.digest, ref.layout.replace(b"512", b"511")
        )
        with pytest.raises(WeightIntegrityError, match="layout"):
            read_slot(other, engine_side)
        with pytest.raises(WeightIntegrityError):  # a version the slot does not hold
            read_slot(SlotRef(ref.kind, ref.path, ref.ipc, 7, ref.digest, ref.layout), engine_side)
        _corrupt(ref.path)
        with pytest.raises(WeightIntegrityError, match="digest"):
            read_slot(ref, engine_side)
        got.release()
    finally:
        trainer.close()


def test_a_slot_corrupted_after_the_raas_checked_it_is_refused_by_the_engine() -> None:
    from astraflow.weights.transport import SharedTransport

    trainer = SharedTransport(torch.device("cpu"), policy="p")
    raas = SharedTransport(torch.device("cpu"))
    engine = SlotEngine(OLD)
    try:
        offer = trainer.publish(1, _scaled(5.0))
        assert offer is not None
        got = raas.receive(VersionInfo(policy="p", version=1, weights_addr="", offers=[offer]), offer)
        assert got.slot is not None
        _corrupt(got.slot.path)  # after the RaaS's own check passed
        assert engine.load_slot(1, got.slot)
        assert "digest" in engine.wait_error(30.0)
        assert engine.version == 0 and torch.equal(engine.params["w"], OLD["w"])  # the old weights stay
        got.release()
    finally:
        trainer.close()


def test_a_slot_the_engine_refuses_is_fetched_again_by_the_next_path() -> None:
    """The slot's bytes go bad between the RaaS's check and the engine's read: the engine refuses it
    and keeps its weights; the RaaS fetches the version again, its own check of the slot fails now,
    and the ZeroMQ pull brings the version, handed over as tensors; the slot's lock is let go."""
    from astraflow.metrics.role_stats import PullStats
    from astraflow.roles.weight_sync import WeightSync
    from astraflow.weights.server import WeightServer
    from astraflow.weights.snapshot import state_dict_to_bytes
    from astraflow.weights.transport import SharedTransport, ZmqTransport

    trainer = SharedTransport(torch.device("cpu"), policy="p")
    server = WeightServer("127.0.0.1", chunk_bytes=4096)
    engine = SlotEngine(OLD)
    engine.before_read = _corrupt
    new = _scaled(7.0)

    async def scenario() -> None:
        cpu = torch.device("cpu")
        sync = WeightSync(
            {"p": engine}, {"shm": SharedTransport(cpu), "zmq": ZmqTransport()}, ["ipc", "zmq"], PullStats()
        )
        offer = trainer.publish(1, new)
        assert offer is not None
        m = server.publish("p", 1, state_dict_to_bytes(new))
        v1 = VersionInfo(policy="p", version=1, weights_addr=server.address, sha256=m.sha256, offers=[offer])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60.0
        while engine.version < 1:
            assert loop.time() < deadline, (engine.got, engine.error, sync.last_error)
            sync.poll({"p": v1})  # the worker's loop polls its announced versions like this
            await sync.until_settled(1.0)
            await asyncio.sleep(0.05)
        assert engine.got == ["slot", "tensors"] and sync.paths["p"] == "zmq"
        assert "digest" in engine.error and "refused from its slot" in sync.last_error
        assert torch.equal(engine.params["w"], new["w"]) and torch.equal(engine.params["b"], new["b"])
        await _publish(trainer, 2, new)  # both slots free again: the refused one was let go
        await _publish(trainer, 3, new)

    try:
        asyncio.run(scenario())
    finally:
        trainer.close()
        server.close()

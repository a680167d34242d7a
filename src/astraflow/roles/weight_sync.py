"""A RaaS's weight pipeline, one explicit state machine per policy:

    idle -> fetching -> staged -> applied
                 \\-> idle (failed: retried)   \\-> rejected (the engine refused it: never retried)
                                               \\-> idle (the slot failed the engine's check: refetched)

`PolicySync` is the pure core (no sockets, no threads: unit-tested as is); `WeightSync` drives it for
a worker: it fetches each announced version by the fastest transport the pair shares
(weights/transport.py), falling back path by path, hands the tensors to the engine (which applies
them between decode steps), or, to an engine that maps same-host slots itself, a reference to the
slot (`load_slot`), and releases a shared slot once its engine has copied it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from astraflow import log
from astraflow.protocol.messages import VersionInfo

if TYPE_CHECKING:
    from astraflow.config.recipe import WeightsConfig
    from astraflow.engines.base import RolloutEngine

_log = log.get("raas.weights")
RETRY_S = 0.5
"""A failed fetch of a version is tried again after this long (a newer version is fetched at once)."""


class State(Enum):
    """Where a policy's newest wanted version is."""

    IDLE = "idle"
    FETCHING = "fetching"
    STAGED = "staged"
    APPLIED = "applied"
    REJECTED = "rejected"


@dataclass
class PolicySync:
    """The state of one policy's weights on one worker."""

    policy: str
    engine_version: int = 0
    state: State = State.IDLE
    target: VersionInfo | None = None
    """The version being fetched, staged or last applied/rejected."""
    rejected: set[tuple[int, str]] = field(default_factory=set)
    """(version, address) the engine refused: never fetched again."""
    retry_at: float = 0.0
    slot_refused: set[int] = field(default_factory=set)
    """Versions the engine would not read from their same-host slot: given to it as tensors next time."""

    def on_announce(self, info: VersionInfo, now: float) -> bool:
        """A version was announced; True when it should be fetched now (state -> fetching)."""
        staged = self.target.version if self.state is State.STAGED and self.target else -1
        if info.version <= max(self.engine_version, staged) or not (info.weights_addr or info.offers):
            return False
        key = (info.version, info.weights_addr)
        if key in self.rejected:
            return False
        same = self.target is not None and (self.target.version, self.target.weights_addr) == key
        if same and (self.state is State.FETCHING or now < self.retry_at):
            return False
        self.state, self.target = State.FETCHING, info
        return True

    def on_fetched(self, info: VersionInfo) -> bool:
        """A fetch finished; True when it should be staged (it was not superseded meanwhile)."""
        if self.state is not State.FETCHING or self.target is not info:
            return False
        self.state = State.STAGED
        return True

    def on_failed(self, info: VersionInfo, now: float) -> None:
        """A fetch failed on every path: back to idle, asked again after RETRY_S."""
        if self.target is info and self.state is State.FETCHING:
            self.state, self.retry_at = State.IDLE, now + RETRY_S

    def on_rejected(self, info: VersionInfo) -> None:
        """The engine refused the weights: the old ones stay; this version is never fetched again."""
        self.rejected.add((info.version, info.weights_addr))
        if self.target is info:
            self.state = State.REJECTED

    def on_slot_refused(self, info: VersionInfo, now: float) -> None:
        """The engine read a staged version from its slot and a check failed there (the old weights
        stay): back to idle, fetched again after RETRY_S and then handed over as tensors (a slot whose
        bytes are bad fails the worker's own check then, and the next path is taken)."""
        self.slot_refused.add(info.version)
        if self.target is info and self.state is State.STAGED:
            self.state, self.retry_at = State.IDLE, now + RETRY_S

    def on_engine(self, version: int) -> None:
        """The engine decodes with `version` now."""
        self.engine_version = version
        if self.state is State.STAGED and self.target is not None and version >= self.target.version:
            self.state = State.APPLIED

    @property
    def pending(self) -> bool:
        """Weights are on their way (fetching) or waiting for the engine (staged)."""
        return self.state in (State.FETCHING, State.STAGED)


class WeightSync:
    """Drives one PolicySync per engine for a worker (call `poll` from its event loop)."""

    def __init__(
        self, engines: dict[str, Any], transports: dict[str, Any], allowed: list[str], stats: Any
    ) -> None:
        """`transports`: kind -> WeightTransport (worker side); `allowed`: the recipe's weights.transports."""
        self.engines = engines
        self.transports = transports
        self.allowed = allowed
        self.stats = stats
        self.policies = {name: PolicySync(name, e.version) for name, e in engines.items()}
        self.last_error = ""
        self.paths: dict[str, str] = {}
        """Policy -> the transport its newest version came by (for logs and stats)."""
        self.changed = asyncio.Event()

    def poll(self, versions: dict[str, VersionInfo]) -> None:
        """Start fetching every policy whose announced version is newer than what it holds."""
        now = time.monotonic()
        for name, ps in self.policies.items():
            ps.on_engine(self.engines[name].version)
            info = versions.get(name)
            if info is not None and ps.on_announce(info, now):
                asyncio.get_running_loop().create_task(self._fetch(ps, info))

    def pending(self) -> bool:
        """Some policy's weights are being fetched or wait to be applied."""
        for name, ps in self.policies.items():
            ps.on_engine(self.engines[name].version)
        return any(ps.pending for ps in self.policies.values())

    async def until_settled(self, timeout: float) -> None:
        """Wait until nothing is pending, or `timeout` passes (woken by each transition)."""
        deadline = time.monotonic() + timeout
        while self.pending() and (left := deadline - time.monotonic()) > 0:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 0.05))
            except TimeoutError:
                pass  # an engine applies in its own thread; look at its version again

    async def _fetch(self, ps: PolicySync, info: VersionInfo) -> None:
        from astraflow.weights.transport import choose

        engine = self.engines[ps.policy]
        got = None
        t0 = time.perf_counter()
        for transport, offer in choose(info, self.transports, self.allowed):
            try:
                got = await in_daemon_thread(transport.receive, info, offer)
                self.paths[ps.policy] = transport.kind if offer is None else offer.kind
                _log.debug("%s version %d by %s", ps.policy, info.version, self.paths[ps.policy])
                break
            except Exception as exc:  # this path failed: the next one (last: the ZeroMQ pull)
                _log.warning(
                    "%s version %d by %s failed: %s",
                    ps.policy,
                    info.version,
                    getattr(offer, "kind", "zmq"),
                    exc,
                )
        t1 = time.perf_counter()
        if got is None:
            ps.on_failed(info, time.monotonic())
            self.changed.set()
            return
        if not ps.on_fetched(info):
            got.release()
            return
        try:
            if info.version in ps.slot_refused or not _hand_slot(engine, info.version, got):
                tensors = got.tensors
                if got.lent and not hasattr(engine, "wait_version"):
                    # this engine cannot say when it copied: give it copies and let the buffer go
                    tensors = {k: v.clone() for k, v in tensors.items()}
                    got.release()
                engine.load_weights(info.version, tensors)
        except Exception as exc:  # weights that do not fit: keep the old ones, report, never retry
            got.release()
            ps.on_rejected(info)
            self.last_error = (
                f"could not apply {ps.policy} version {info.version}: {type(exc).__name__}: {exc}"[:2000]
            )
            _log.error("%s; keeping version %d", self.last_error, engine.version)
            self.changed.set()
            return
        self.stats.add(ps.policy, t1 - t0, time.perf_counter() - t1, got.nbytes)
        loop = asyncio.get_running_loop()

        def slot_refused() -> None:
            try:
                loop.call_soon_threadsafe(self._on_slot_refused, ps, info)
            except RuntimeError:
                pass  # the loop is gone: the worker is exiting

        _watch_apply(engine, info.version, got, slot_refused)
        self.changed.set()

    def _on_slot_refused(self, ps: PolicySync, info: VersionInfo) -> None:
        engine = self.engines[ps.policy]
        ps.on_slot_refused(info, time.monotonic())
        why = getattr(engine, "last_error", "") or "a check failed where it read the slot"
        self.last_error = f"{ps.policy} version {info.version} refused from its slot: {why}"[:2000]
        _log.warning("%s; fetching it again", self.last_error)
        self.changed.set()


def _hand_slot(engine: Any, version: int, got: Any) -> bool:
    """Hand the engine a reference to the same-host slot `got` came from, if it takes one (it then maps
    the slot itself); False: the engine is to be given the tensors."""
    load_slot = getattr(engine, "load_slot", None)
    if got.slot is None or not callable(load_slot) or not hasattr(engine, "wait_version"):
        return False  # an engine that cannot say when it read the slot would keep it locked forever
    return bool(load_slot(version, got.slot))


def _watch_apply(engine: Any, version: int, got: Any, on_slot_refused: Any) -> None:
    """Until the engine decodes with `version` (or a newer one), says it refused `version` from its
    slot (`slot_refused(version)`, optional) or dies: then release a shared slot or a lent receive
    buffer, and tell `on_slot_refused` of a refusal."""
    refused = getattr(engine, "slot_refused", None)
    if not hasattr(engine, "wait_version") or not (got.lent or callable(refused)):
        return

    def wait() -> None:
        try:
            while not engine.wait_version(version, timeout=1.0):
                if callable(refused) and refused(version):
                    on_slot_refused()
                    break
                if not getattr(engine, "healthy", lambda: True)():
                    break  # a dead engine reads nothing more
        finally:
            got.release()

    threading.Thread(target=wait, name=f"release-{version}", daemon=True).start()


def make_weight_sync(
    engines: dict[str, RolloutEngine], w: WeightsConfig, member_id: str, stats: Any, fetch: Any = None
) -> WeightSync:
    """The worker side of every weight transport `[weights]` allows, driven per policy."""
    import torch

    from astraflow.weights.transport import BroadcastTransport, SharedTransport, ZmqTransport

    devices = [getattr(e, "device", None) for e in engines.values()]
    device = next((d for d in devices if isinstance(d, torch.device)), torch.device("cpu"))
    transports: dict[str, Any] = {"zmq": ZmqTransport(fetch)}
    if "ipc" in w.transports:
        transports["shm"] = SharedTransport(device)
    if "broadcast" in w.transports:
        transports["broadcast"] = BroadcastTransport(
            device, member_id=member_id, timeout_s=w.broadcast_timeout_s
        )
    return WeightSync(engines, transports, list(w.transports), stats)


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """Run a blocking call in a daemon thread: a pull stuck on a vanished trainer never blocks exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Any, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(lambda: fut.done() or setter(value))
        except RuntimeError:
            pass  # the loop is gone: the worker is exiting and nobody waits for this pull

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            settle(fut.set_exception, exc)
        else:
            settle(fut.set_result, result)

    threading.Thread(target=work, daemon=True, name=f"pull-{getattr(fn, '__name__', 'call')}").start()
    return await fut

"""The RaaS service: pulls tasks when it has free slots, runs workflow episodes against its engines,
and pulls new weights as versions appear, applying them between decode steps.

Over 400 lines because it is one class, the worker, with its task loop, result reporting, weight
pulls and stats; what a workflow sees of a policy is in roles/policy_client.py, the weight pipeline
in roles/weight_sync.py, the recipe sections it reads in roles/raas_sections.py."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import traceback
import zlib
from typing import TYPE_CHECKING, Any

from astraflow import log
from astraflow.engines.base import RolloutEngine
from astraflow.errors import AstraflowError
from astraflow.roles.policy_client import EnginePolicyClient, TaskPolicyClient
from astraflow.roles.raas_sections import RaaSSections

if TYPE_CHECKING:
    from astraflow.transport.client import MemberClient

_log = log.get("raas")
RESULT_ATTEMPTS = 30
TASK_WAIT_S = 1.0
"""How long a TaskRequest asks the controller to hold it when nothing may be leased (a long poll)."""
MAX_ERROR_CHARS = 8000
"""Longest traceback sent in a result's error (the controller logs it)."""


def _install_signal_handlers(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event, drain: asyncio.Event
) -> None:
    """SIGTERM and SIGINT: the first drains (finish or return the leases, then leave); a second stops at
    once, and so does the first when the process that started this worker died (the kernel's death
    signal from `up`: the controller goes down with it, so a drain would only wait on it)."""
    parent = os.getppid()

    def on_signal() -> None:
        if drain.is_set() or os.getppid() != parent:
            if not drain.is_set():
                _log.info("the launcher that started this worker is gone: stopping")
            stop.set()
        else:
            _log.info("asked to stop: draining (no new tasks; finishing the running ones)")
            drain.set()

    def on_os_signal(_signum: int, _frame: Any) -> None:
        # a plain handler that stays installed after the loop ends: a SIGTERM during shutdown is harmless
        try:
            loop.call_soon_threadsafe(on_signal)
        except RuntimeError:
            pass  # the loop is closed: the worker is already leaving

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_os_signal)


class RaaS:
    """One rollout worker: engines for the policies it serves, a workflow, and the task loop."""

    def __init__(
        self,
        client: MemberClient,
        sections: RaaSSections,
        *,
        policies: list[str],
        engine_override: str | None,
        slots: int,
        member_id: str,
    ) -> None:
        from transformers import AutoTokenizer

        from astraflow import plugins

        self.client = client
        self.sections = sections
        self.slots = slots
        self.roles = sections.roles
        wf_cls = plugins.load("workflows", sections.workflow.name)
        self.workflow = wf_cls(wf_cls.Config.model_validate(sections.workflow.options))
        needed = sorted(sections.policies)
        if policies:
            missing = [p for p in needed if p not in policies]
            if missing:
                _log.warning(
                    "workflow needs policies %s that this worker was not asked to serve; serving them anyway",
                    missing,
                )
        self.engines: dict[str, RolloutEngine] = {}
        self.clients: dict[str, EnginePolicyClient] = {}
        for name in needed:
            pol = sections.policies[name]
            engine_name = engine_override or pol.engine
            eng_cls = plugins.load("engines", engine_name)
            cfg = (
                eng_cls.Config.model_validate(pol.engine_options)
                if getattr(eng_cls, "Config", None)
                else None
            )
            engine = eng_cls(pol.model, cfg, seed=sections.seed * 1_000_003 + zlib.crc32(member_id.encode()))
            tok = AutoTokenizer.from_pretrained(pol.model)
            stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
            self.engines[name] = engine
            self.clients[name] = EnginePolicyClient(name, tok, engine, pol.sampling, stop)
        self.busy = 0
        self.tasks_done = 0
        self.active: set[int] = set()
        """Task ids running now: the heartbeat reports progress on these (only they are renewed)."""
        self.last_error = ""
        """The newest failure this worker survived, reported in heartbeats."""
        self.fatal = ""
        """Why the worker must stop at once (its decode loop died): it exits 1 without heartbeating."""
        self.draining = False
        from astraflow.metrics.role_stats import PullStats, StatsWriter

        self.pull_stats = PullStats()
        self.stats_writer = StatsWriter()
        self.started = time.time()
        self.member_id = member_id
        self._held_lock = threading.Lock()
        self.recv_buffers: Any = None
        """Receive buffers the ZeroMQ pulls reuse (weights/client.py: RecvBuffers), made on the first pull."""
        from astraflow.roles.weight_sync import make_weight_sync

        self.weights = make_weight_sync(
            self.engines, sections.weights, member_id, self.pull_stats, self._fetch
        )
        """The per-policy weight pipeline (roles/weight_sync.py)."""

    def loaded(self) -> dict[str, int]:
        """Policy -> version each engine decodes with now."""
        return {p: e.version for p, e in self.engines.items()}

    async def run(self) -> int:
        """The main loop; returns when the controller says stop or on SIGTERM: lease tasks while there
        are free slots, drain the running ones when asked to, then close everything."""
        stop = asyncio.Event()
        drain = asyncio.Event()
        _install_signal_handlers(asyncio.get_running_loop(), stop, drain)
        ticker = asyncio.create_task(self._tick(stop))
        running: set[asyncio.Task[None]] = set()
        try:
            await self._lease_loop(stop, drain, running)
            if drain.is_set() and running and not stop.is_set():
                await self._drain(running, stop)
        finally:
            self._shut_down(running, ticker)
        if self.fatal:
            _log.error("stopping: %s", self.fatal)
            return 1
        _log.info("stopping after %d tasks", self.tasks_done)
        return 0

    async def _lease_loop(
        self, stop: asyncio.Event, drain: asyncio.Event, running: set[asyncio.Task[None]]
    ) -> None:
        """Ask for as many tasks as there are free slots and start each one, until told to stop or drain."""
        from astraflow.errors import ConnectError
        from astraflow.protocol.messages import TaskRequest

        while not stop.is_set() and not self.client.stop_requested and not drain.is_set():
            self._maybe_pull_weights()
            free = self.slots - self.busy
            if free <= 0:
                await asyncio.sleep(0.02)
                continue
            # a long poll, unless weights are on their way: the controller is then asked again as
            # soon as they are loaded (the lease rule looks at the loaded version)
            wait = 0.0 if self._pull_pending() else TASK_WAIT_S
            try:
                reply = await self._ask(TaskRequest(n=free, loaded=self.loaded(), wait_s=wait), stop)
            except ConnectError:
                _log.warning("controller not answering; asking again until it is back")
                # a revoked key or a wrong address: exit with the reason instead of asking forever
                await asyncio.to_thread(self.client.check_reachable)
                await asyncio.sleep(1.0)
                continue
            if reply is None or not await self._on_task_reply(reply, wait, stop, drain, running):
                break

    async def _on_task_reply(
        self,
        reply: Any,
        wait: float,
        stop: asyncio.Event,
        drain: asyncio.Event,
        running: set[asyncio.Task[None]],
    ) -> bool:
        """Act on the controller's answer to a TaskRequest; False when the worker must stop asking."""
        from astraflow.protocol.messages import Error, TaskGrant

        if isinstance(reply, Error):
            if reply.code == "draining":
                _log.info("the controller asks this worker to leave: draining")
                drain.set()
                return False
            _log.warning("task request refused: %s %s", reply.code, reply.message)
            await asyncio.sleep(0.5)
            return True
        if not isinstance(reply, TaskGrant):
            await asyncio.sleep(0.1)
            return True
        if reply.stop:
            return False
        for task in reply.tasks:
            self.busy += 1
            t = asyncio.create_task(self._run_task(task))
            running.add(t)
            t.add_done_callback(running.discard)
        if not reply.tasks:
            await self._idle(reply.retry_after_s, wait, stop)
        return True

    async def _idle(self, retry_after_s: float, wait: float, stop: asyncio.Event) -> None:
        """Nothing was granted: wait for weights on their way, or (after a short poll) the retry delay."""
        self._maybe_pull_weights()  # the reply may name a new version
        pause = max(0.02, retry_after_s or 0.1)
        if self._pull_pending():
            await self._until_loaded(stop, timeout=pause)
        elif wait == 0.0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=pause)
            except TimeoutError:
                pass

    async def _drain(self, running: set[asyncio.Task[None]], stop: asyncio.Event) -> None:
        """Let the running tasks finish, up to the recipe's drain timeout (or until a second signal)."""
        self.draining = True
        timeout = self.sections.rollout.drain_timeout_s
        _log.info("waiting up to %.0fs for %d running tasks", timeout, len(running))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({*running, stopper}, timeout=timeout, return_when=asyncio.ALL_COMPLETED)
        stopper.cancel()
        if running:
            _log.warning("%d tasks still running after the drain; returning their leases", len(running))

    def _shut_down(self, running: set[asyncio.Task[None]], ticker: asyncio.Task[None]) -> None:
        """Cancel what still runs, flush the stats, close engines and weight transports."""
        for t in running:
            t.cancel()
        ticker.cancel()
        if getattr(self, "result_sender", None) is not None:
            self.result_sender.close()
        self._write_stats(force=True)
        try:
            self.workflow.close()
        except Exception as exc:  # what it started dies with this process anyway
            _log.warning("closing the workflow failed: %s", exc)
        for e in self.engines.values():
            e.close()
        for t in self.weights.transports.values():
            t.close()

    def _pull_pending(self) -> bool:
        """Weights of some policy are being fetched, or fetched and not yet applied by its engine."""
        return self.weights.pending()

    async def _until_loaded(self, stop: asyncio.Event, timeout: float) -> None:
        """Wait until no weights are pending, the worker stops, or `timeout` passes."""
        if not stop.is_set():
            await self.weights.until_settled(timeout)

    async def _ask(self, msg: Any, stop: asyncio.Event) -> Any:
        """Send a request and await its reply, or None as soon as the worker is told to stop."""
        wait = float(getattr(msg, "wait_s", 0.0))
        # a long poll held by a controller that then died is never answered: the restarted one's
        # HeartbeatAck names it lost at once; this shorter deadline is the fallback if none does
        reply = asyncio.wrap_future(
            self.client.submit(msg, timeout_s=10.0 + wait) if wait > 0 else self.client.submit(msg)
        )
        stopped = asyncio.ensure_future(stop.wait())
        racing: set[asyncio.Future[Any]] = {reply, stopped}
        done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if reply not in done:
            reply.cancel()
            return None
        stopped.cancel()
        return reply.result()

    async def _tick(self, stop: asyncio.Event) -> None:
        """Prove liveness (the hang watchdog) and report load, a few times a second."""
        while not stop.is_set():
            dead = [p for p, e in self.engines.items() if not engine_alive(e)]
            if dead:
                # no tick: heartbeats stop, so the controller takes the leases back; then exit 1
                self.fatal = f"the decode loop of policy {dead[0]!r} died"
                self.last_error = self.fatal
                stop.set()
                return
            self.client.tick()
            self.client.set_load(self.loaded(), self.busy, self.slots - self.busy)
            self.client.set_progress(sorted(self.active), self.last_error)
            self._write_stats()
            await asyncio.sleep(0.2)

    def _write_stats(self, force: bool = False) -> None:
        """Append this worker's counters to its stats file, when `up` gave it one (metrics/role_stats.py)."""
        from astraflow.metrics.role_stats import raas_snapshot

        if self.stats_writer.path is not None:
            snap = raas_snapshot(self.member_id, self.started, self.engines, self.pull_stats)
            self.stats_writer.maybe_write(snap, force=force)

    async def _run_task(self, task: Any) -> None:
        """Run one task's group of episodes and report the result (or the error)."""
        from astraflow.protocol.messages import Outcome, pack_episodes

        self.active.add(task.task_id)
        try:
            sizes = {
                role: int(task.group_sizes.get(pol, task.group_size)) for role, pol in task.roles.items()
            }
            clients = {
                role: TaskPolicyClient(
                    self.clients[pol],
                    sizes[role],
                    pol in task.read_only,
                    dict(task.sampling),
                    (self.sections.seed, task.task_id, role),
                )
                for role, pol in task.roles.items()
            }
            episodes = await asyncio.wait_for(
                self.workflow.run_group(dict(task.sample), clients, sizes),
                timeout=self.sections.rollout.task_timeout_s,
            )
            result = Outcome(task_id=task.task_id, epoch=task.epoch, episodes=pack_episodes(list(episodes)))
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            _log.error("task %d ran past rollout.task_timeout_s; reporting it failed", task.task_id)
            result = Outcome(task_id=task.task_id, epoch=task.epoch, error="task_timeout")
        except Exception as exc:
            _log.error(
                "task %d failed: %s", task.task_id, "".join(traceback.format_exception_only(exc)).strip()
            )
            # the whole traceback goes to the controller's log; the tail keeps the exception line
            tb = "".join(traceback.format_exception(exc))
            result = Outcome(task_id=task.task_id, epoch=task.epoch, error=tb[-MAX_ERROR_CHARS:])
        try:
            ack = await self._results().deliver(result)
            self.tasks_done += 1
            if ack.status == "invalid":
                _log.warning("result of task %d refused: %s %s", task.task_id, ack.code, ack.message)
        except Exception as exc:
            _log.warning(
                "result of task %d not delivered (%s); its lease will expire and requeue it",
                task.task_id,
                exc,
            )
        finally:
            self.busy -= 1
            self.active.discard(task.task_id)

    def _results(self) -> Any:
        """The group-commit sender of this worker's results (roles/result_sender.py), made on first use."""
        from astraflow.roles.result_sender import ResultSender

        sender = getattr(self, "result_sender", None)
        if sender is None:
            sender = self.result_sender = ResultSender(self.client.submit, attempts=RESULT_ATTEMPTS)
        return sender

    def _maybe_pull_weights(self) -> None:
        """Hand the announced versions to the weight pipeline; it fetches what is newer."""
        self.weights.poll(self.client.versions)
        if self.weights.last_error:
            self.last_error, self.weights.last_error = self.weights.last_error, ""

    def _held_weights(self) -> Any:
        """The versions this worker keeps for deltas and serves as a relay (made on the first pull)."""
        from astraflow.weights.fetch import HeldWeights

        cfg = self.sections.weights
        held = getattr(self, "held_weights", None)
        if held is None:
            relay = None
            if cfg.relays:
                from astraflow.roles.member import advertise_host
                from astraflow.weights.relay import relay_server

                relay = relay_server(cfg, advertise_host(self.client.controller))
                self.client.relay_addr = relay.address
            held = self.held_weights = HeldWeights(relay)
            self.pull_stats.ways = held.counts
        return held

    def _fetch(self, info: Any) -> Any:
        """The ZeroMQ path of one version as `[weights]` says: delta chain or full, relays of the
        region first (weights/fetch.py); a Received whose buffer is lent when no version is held."""
        from astraflow.weights.client import RecvBuffers
        from astraflow.weights.fetch import fetch_version
        from astraflow.weights.shared_buffer import Received

        cfg = self.sections.weights
        with self._held_lock:  # two policies' pulls run on their own threads
            held = self._held_weights()
            if self.recv_buffers is None:
                self.recv_buffers = RecvBuffers(keep=2 * len(self.engines))
        fetched = fetch_version(
            [*info.relays, info.weights_addr],
            info.policy,
            info.version,
            expect_sha256=info.sha256,
            # full pulls without relays need no copy of the version beside the engine's
            held=held if cfg.mode == "delta" or cfg.relays else None,
            delta=cfg.mode == "delta",
            max_chain=cfg.max_chain,
            relay_wait_s=cfg.relay_wait_s,
            delta_wait_s=cfg.delta_wait_s,
            into=self.recv_buffers,
            connections=cfg.pull_connections,
        )
        return Received(info.version, fetched.state_dict, fetched.nbytes, _on_release=fetched.release)


def engine_alive(engine: Any) -> bool:
    """Whether an engine can still decode: its `healthy()` if it has one, else its decode thread's liveness."""
    healthy = getattr(engine, "healthy", None)
    if callable(healthy):
        return bool(healthy())
    thread = getattr(engine, "_thread", None)
    return thread.is_alive() if isinstance(thread, threading.Thread) else True


def run_raas(
    controller: str,
    *,
    policies: list[str],
    engine: str | None = None,
    region: str = "",
    slots: int | None = None,
    member_id: str | None = None,
    connect_timeout_s: float = 30.0,
) -> int:
    """Join the controller as a rollout worker and serve until told to stop."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from astraflow.models.dirs import require_model_dirs
    from astraflow.roles.member import connect_retrying, make_hello
    from astraflow.transport.client import MemberClient

    hello = make_hello("raas", member_id, policies=policies, region=region, slots=slots or 0)
    client = MemberClient(controller, hello, connect_timeout_s=connect_timeout_s)
    welcome = connect_retrying(client)
    try:
        sections = RaaSSections.from_wire(welcome.sections)
    except AstraflowError:
        client.close("bad sections")
        raise
    require_model_dirs(list(sections.policies.values()), client)
    import torch

    torch.set_num_threads(sections.rollout.threads)
    n_slots = slots or sections.rollout.slots
    try:
        worker = RaaS(
            client,
            sections,
            policies=policies,
            engine_override=engine,
            slots=n_slots,
            member_id=hello.member_id,
        )
        rc = asyncio.run(worker.run())
        client.close(worker.fatal or "done")
        return rc
    finally:
        client.close("done")

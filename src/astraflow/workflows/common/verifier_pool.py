"""A pool of worker processes for reward functions, each call bounded by a timeout that kills the worker.

Verifiers (math-verify's sympy, a regex on model output) can take unbounded time on adversarial
input; a thread cannot be stopped, so they run in processes. A call that overruns its timeout kills
its worker and starts a fresh one; the caller gets a timeout result and the pool keeps its size.
Workers are started with the spawn method (never fork a process that holds torch threads) and import
the function once, so the import cost is paid per worker, not per call. Modules the function imports
lazily (math-verify's sympy, say) can be named in `preload`: a worker imports them before it counts
as started, so a first call does not spend its timeout importing them.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 120.0
"""How long a fresh worker may take to import its target."""


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _serve(target: str, conn: Connection, preload: tuple[str, ...] = ()) -> None:
    fn = _resolve(target)
    for module in preload:
        importlib.import_module(module)
    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, fn(*args)))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"[:500]))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False


@dataclass(frozen=True)
class CallResult:
    """One call's outcome."""

    ok: bool
    value: Any = None
    error: str = ""
    """timeout, or the exception the function raised."""


class VerifierPool:
    """`workers` processes running `target` ("module:function"); async `call(*args)`."""

    def __init__(
        self, target: str, workers: int = 2, timeout_s: float = 10.0, preload: tuple[str, ...] = ()
    ) -> None:
        """`timeout_s`: a call running longer kills its worker. `preload`: modules each worker imports
        before its first call (not in the caller: they may be heavy)."""
        _resolve(target)  # fail here, in the caller, if the target does not exist
        self.target = target
        self.preload = tuple(preload)
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [self._spawn() for _ in range(workers)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self.timeouts = 0
        """Calls that were killed at the timeout."""

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(self.target, child, self.preload), daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _queue(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for w in self._workers:
                self._idle.put_nowait(w)
        return self._idle

    async def call(self, *args: Any) -> CallResult:
        """Run the target on `args` in a free worker; a worker that overruns is killed and replaced."""
        idle = self._queue()
        worker = await idle.get()
        try:
            if not worker.ready:
                # A fresh worker first imports the target; that start-up is not the call's time.
                if not await asyncio.to_thread(worker.conn.poll, START_TIMEOUT_S):
                    raise OSError("worker did not start")
                worker.conn.recv()
                worker.ready = True
            worker.conn.send(args)
            ready = await asyncio.to_thread(worker.conn.poll, self.timeout_s)
            if ready:
                ok, value = worker.conn.recv()
                return CallResult(ok, value if ok else None, "" if ok else str(value))
            self.timeouts += 1
            worker = self._replace(worker)
            return CallResult(False, error="timeout")
        except (EOFError, OSError, BrokenPipeError) as exc:
            worker = self._replace(worker)
            return CallResult(False, error=f"worker died: {exc}")
        except BaseException:
            # Cancelled mid-call: the worker's pending answer would reach the next caller; replace it.
            worker = self._replace(worker)
            raise
        finally:
            idle.put_nowait(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.process.kill()
        worker.process.join(5)
        worker.conn.close()
        fresh = self._spawn()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        """Stop every worker."""
        for w in self._workers:
            w.conn.close()
            w.process.kill()
            w.process.join(5)

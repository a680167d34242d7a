"""A RaaS's group commit: the results its tasks finish are sent together, one TaskResults at a time.

Every finished task hands its result to `ResultSender.deliver` and waits for that result's ack. One
sender task sends what is waiting as one `TaskResults` (at most `MAX_RESULTS`, their sequences joined
into columns by `TaskResults.of`: protocol/columns.py); results that finish
while it is in flight wait for the next one. So a worker with one task at a time sends one result a
message, and a busy worker sends many: the controller stores each message in one transaction.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from astraflow import log
from astraflow.errors import ConnectError
from astraflow.protocol.messages import MAX_RESULTS, Error, Msg, Outcome, OutcomeAck, ResultsAck, TaskResults

_log = log.get("raas")


class ResultSender:
    """Sends the results of finished tasks in groups and hands each task its own ack."""

    def __init__(
        self,
        submit: Callable[[Msg], concurrent.futures.Future[Msg]],
        *,
        attempts: int = 30,
        retry_s: float = 1.0,
    ) -> None:
        self.submit = submit
        self.attempts = attempts
        """Tries per group while the controller does not answer (it may be restarting; results are idempotent)."""
        self.retry_s = retry_s
        self._queue: list[tuple[Outcome, asyncio.Future[OutcomeAck]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.messages = 0
        """TaskResults messages sent so far."""

    async def deliver(self, outcome: Outcome) -> OutcomeAck:
        """Queue one result and wait for its ack; raises ConnectError once every attempt went unanswered."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._wake is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        fut: asyncio.Future[OutcomeAck] = loop.create_future()
        self._queue.append((outcome, fut))
        self._wake.set()
        return await fut

    def close(self) -> None:
        """Stop the sender task (results still waiting get no answer)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                group, self._queue = self._queue[:MAX_RESULTS], self._queue[MAX_RESULTS:]
                group = [(o, f) for o, f in group if not f.done()]  # a waiter cancelled meanwhile
                if group:
                    await self._send(group)

    async def _send(self, group: list[tuple[Outcome, asyncio.Future[OutcomeAck]]]) -> None:
        msg = TaskResults.of([o for o, _ in group])
        reply: Msg | None = None
        for attempt in range(self.attempts):
            try:
                reply = await asyncio.wrap_future(self.submit(msg))
                break
            except ConnectError as exc:
                if attempt + 1 == self.attempts:
                    _fail(group, exc)
                    return
                await asyncio.sleep(self.retry_s)
            except Exception as exc:  # the client closed under us: the tasks' leases will lapse
                _fail(group, exc)
                return
        self.messages += 1
        if isinstance(reply, ResultsAck) and len(reply.acks) == len(group):
            for (_, fut), ack in zip(group, reply.acks, strict=True):
                if not fut.done():
                    fut.set_result(ack)
            return
        why = f"{reply.code}: {reply.message}" if isinstance(reply, Error) else type(reply).__name__
        _log.warning("%d results refused as a whole (%s)", len(group), why)
        for o, fut in group:
            if not fut.done():
                fut.set_result(OutcomeAck(task_id=o.task_id, status="invalid", code="refused", message=why))


def _fail(group: list[tuple[Outcome, asyncio.Future[OutcomeAck]]], exc: BaseException) -> None:
    for _, fut in group:
        if not fut.done():
            fut.set_exception(exc)

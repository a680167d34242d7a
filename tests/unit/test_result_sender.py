"""The RaaS's group commit (roles/result_sender.py) against a controller stand-in that answers when told:
results that finish while a TaskResults is in flight travel together in the next one, each task gets
its own ack, and an unanswered send is retried."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from astraflow.errors import ConnectError
from astraflow.protocol import messages as m
from astraflow.roles.result_sender import ResultSender


class _Controller:
    """Records each submitted message; the test answers them in order (a fake of the member client)."""

    def __init__(self) -> None:
        self.sent: list[m.TaskResults] = []
        self.pending: list[concurrent.futures.Future[m.Msg]] = []

    def submit(self, msg: m.Msg) -> concurrent.futures.Future[m.Msg]:
        assert isinstance(msg, m.TaskResults)
        self.sent.append(msg)
        fut: concurrent.futures.Future[m.Msg] = concurrent.futures.Future()
        self.pending.append(fut)
        return fut

    def answer(self, i: int, status: str = "accepted") -> None:
        acks = [m.OutcomeAck(task_id=o.task_id, status=status) for o in self.sent[i].results]
        self.pending[i].set_result(m.ResultsAck(acks=acks))


async def _until(cond: object) -> None:
    for _ in range(200):
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_results_finished_during_a_send_go_together() -> None:
    async def main() -> None:
        ctl = _Controller()
        sender = ResultSender(ctl.submit, retry_s=0.0)
        first = asyncio.ensure_future(sender.deliver(m.Outcome(task_id=1, epoch=1)))
        await _until(lambda: len(ctl.sent) == 1)
        rest = [asyncio.ensure_future(sender.deliver(m.Outcome(task_id=t, epoch=1))) for t in (2, 3, 4)]
        await asyncio.sleep(0.02)
        assert len(ctl.sent) == 1  # nothing more goes out while the first send is unanswered
        ctl.answer(0)
        assert (await first).status == "accepted"
        await _until(lambda: len(ctl.sent) == 2)
        assert [o.task_id for o in ctl.sent[1].results] == [2, 3, 4]
        ctl.answer(1, "duplicate")
        assert [(await f).task_id for f in rest] == [2, 3, 4]
        assert {(await f).status for f in rest} == {"duplicate"}
        assert sender.messages == 2
        sender.close()

    asyncio.run(main())


def test_an_unanswered_send_is_retried_then_fails() -> None:
    async def main() -> None:
        calls: list[m.Msg] = []

        def submit(msg: m.Msg) -> concurrent.futures.Future[m.Msg]:
            calls.append(msg)
            fut: concurrent.futures.Future[m.Msg] = concurrent.futures.Future()
            fut.set_exception(ConnectError("no reply"))
            return fut

        sender = ResultSender(submit, attempts=3, retry_s=0.0)
        with pytest.raises(ConnectError):
            await sender.deliver(m.Outcome(task_id=7, epoch=2))
        assert len(calls) == 3 and all(isinstance(c, m.TaskResults) for c in calls)
        sender.close()

    asyncio.run(main())

"""Results of one member read in one poll are taken together: the results messages that a member sent
back to back (TaskResult messages, and TaskResults of a few tasks) are stored as one TaskResults would
be, in one transaction and one pass of the checks, the advantages and the writes; each message is still
answered on its own (docs/architecture.md, "Group commit").

A message of one task costs the controller about as much as a TaskResults of dozens (its commit, its
reads of the leases and the policies, its stage-state save), so a member that answers each task in its
own message would otherwise get a fraction of the throughput of one that groups them. Only what the
message-by-message path would answer the same way is merged: a member's consecutive results messages,
without another message of the same member between them, whose sequences fit the columns (a
TaskResults whose columns do not fit together is answered alone, refused whole). Anything the merged
handling refuses as a whole (an unknown member, a refused key, an internal error) is handled again one
message at a time, so every message gets exactly the answer it would have got alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError
from astraflow.protocol.columns import ResultColumns, columnable
from astraflow.roles.controller.outcome import Outcome
from astraflow.transport.principal import Principal

MAX_MERGED = 256
"""Most results taken as one (a member's longer run is taken in several)."""

SMALL = 4
"""Most results of a TaskResults that is merged with others: a larger one is already a group, and
turning its columns back into sequences would cost more than its own transaction."""

Results = m.TaskResult | m.TaskResults

Polled = tuple[bytes, Principal | None, m.Msg | DecodeError]
Replies = list[tuple[bytes, m.Msg]]


class Coalescer:
    """Walks one poll's messages in order: a member's mergeable results messages wait in its run until
    another of its messages, a full run or the poll's end; every other message is dispatched at once."""

    def __init__(
        self,
        dispatch: Callable[[bytes, m.Msg | DecodeError, Principal | None], Replies],
        handle: Callable[[bytes, m.Msg, Principal | None], Outcome],
        deliver: Callable[[Outcome], Replies],
    ) -> None:
        self._dispatch = dispatch
        """One message's replies (the controller's `dispatch`)."""
        self._handle = handle
        """One message's Outcome, nothing sent (the controller's `_handle_safely`)."""
        self._deliver = deliver
        """The replies of held requests that an Outcome's events answer."""

    def replies(self, polled: Iterable[Polled]) -> Iterator[tuple[bytes, m.Msg]]:
        """The replies to one poll's messages, in the order they can be sent."""
        runs: dict[bytes, _Run] = {}
        for ident, principal, msg in polled:
            run = runs.get(ident)
            outcomes = _outcomes(msg)
            if outcomes is not None:
                if run is not None and run.principal != principal:
                    yield from self._flush(ident, runs.pop(ident))
                    run = None
                if run is None:
                    runs[ident] = run = _Run(principal)
                run.add(cast("Results", msg), outcomes)
                if len(run.outcomes) >= MAX_MERGED:
                    yield from self._flush(ident, runs.pop(ident))
                continue
            if run is not None:  # what the member sent before this is answered before it
                yield from self._flush(ident, runs.pop(ident))
            yield from self._dispatch(ident, msg, principal)
        for ident, run in runs.items():
            yield from self._flush(ident, run)

    def _flush(self, ident: bytes, run: _Run) -> Iterator[tuple[bytes, m.Msg]]:
        if len(run.msgs) == 1:
            yield from self._dispatch(ident, run.msgs[0], run.principal)
            return
        done = self._handle(ident, m.TaskResults.of(run.outcomes), run.principal)
        reply = done.reply
        if not isinstance(reply, m.ResultsAck) or len(reply.acks) != len(run.outcomes):
            # refused whole (nothing was stored): each message gets the answer it gets alone
            for msg in run.msgs:
                yield from self._dispatch(ident, msg, run.principal)
            return
        k = 0
        for msg in run.msgs:
            if isinstance(msg, m.TaskResult):
                yield ident, _answer(msg, reply.acks[k])
                k += 1
            else:
                yield ident, m.ResultsAck(rid=msg.rid, acks=reply.acks[k : k + len(msg.results)])
                k += len(msg.results)
        yield from self._deliver(done)


class _Run:
    """A member's results messages waiting to be taken together, and their results in order."""

    __slots__ = ("msgs", "outcomes", "principal")

    def __init__(self, principal: Principal | None) -> None:
        self.principal = principal
        self.msgs: list[Results] = []
        self.outcomes: list[m.Outcome] = []

    def add(self, msg: Results, outcomes: list[m.Outcome]) -> None:
        self.msgs.append(msg)
        self.outcomes += outcomes


def _outcomes(msg: m.Msg | DecodeError) -> list[m.Outcome] | None:
    """A results message's results, if it may be merged: a TaskResult whose sequences fit the columns
    (not an error: nothing to store), or a TaskResults of up to SMALL results whose columns fit."""
    if type(msg) is m.TaskResult:
        if msg.error or not _fits(msg):
            return None
        return [m.Outcome(task_id=msg.task_id, epoch=msg.epoch, episodes=msg.episodes)]
    if type(msg) is m.TaskResults and 0 < len(msg.results) <= SMALL:
        view = ResultColumns(msg)
        return None if view.problem else [view.outcome(i) for i in range(len(msg.results))]
    return None


def _fits(msg: m.TaskResult) -> bool:
    """Whether every sequence of the result can be a slice of the columns (one that cannot is
    answered by the single-result path, which names its fault)."""
    return all(columnable(s) for ep in msg.episodes for s in ep.sequences)


def _answer(msg: m.TaskResult, ack: m.OutcomeAck) -> m.Msg:
    """One merged result's OutcomeAck as the reply its own TaskResult gets alone."""
    if ack.status == "invalid":
        return m.Error(rid=msg.rid, code=ack.code, message=ack.message)
    return m.ResultAck(rid=msg.rid, task_id=ack.task_id, status=ack.status)

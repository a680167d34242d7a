"""Results read in one poll are taken together: the results messages of one poll (TaskResult messages,
and TaskResults of a few tasks), from one member or many, are stored as one TaskResults would be, in
one transaction and one pass of the checks, the advantages and the writes; each result is still
checked against its own member's lease and charged to that member, and each message is answered on its
own (docs/architecture.md, "Group commit").

A message of one task costs the controller about as much as a TaskResults of dozens (its commit, its
reads of the leases and the policies, its stage-state save), so members that answer each task in its
own message would otherwise get a fraction of the throughput of members that group them. Only what the
message-by-message path would answer the same way is merged: results messages of joined, alive
members whose keys may send them, whose sequences fit the columns (a TaskResults whose columns do not
fit together is answered alone, refused whole); a member's other message ends the run, so what it sent
before is answered before it. A run that the merged handling refuses as a whole is handled again
message by message; one whose handling raised has its group's transaction rolled back and each of its
messages answered `internal`, as a failed handler's message is (not handled again: charges already
committed for its invalid results would be counted twice).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError
from astraflow.protocol.columns import ResultColumns, columnable, join, pack
from astraflow.roles.controller.outcome import Outcome
from astraflow.transport.principal import Principal

MAX_MERGED = 256
"""Most results taken as one (a longer run is taken in several)."""

SMALL = 4
"""Most results of a TaskResults that is merged with others: a larger one is already a group, and
turning its columns back into sequences would cost more than its own transaction."""

Results = m.TaskResult | m.TaskResults

Polled = tuple[bytes, Principal | None, m.Msg | DecodeError]
Replies = list[tuple[bytes, m.Msg]]


class Coalescer:
    """Walks one poll's messages in order: results messages of joined members that may send them wait
    in the run until a message of one of their members that is not mergeable, a full run or the
    poll's end; every other message is dispatched at once."""

    def __init__(
        self,
        dispatch: Callable[[bytes, m.Msg | DecodeError, Principal | None], Replies],
        sender: Callable[[bytes, m.Msg, Principal | None], dict[str, Any] | None],
        take: Callable[[list[dict[str, Any]], m.TaskResults], Outcome | None],
        deliver: Callable[[Outcome], Replies],
    ) -> None:
        self._dispatch = dispatch
        """One message's replies (the controller's `dispatch`)."""
        self._sender = sender
        """The member row a results message is handled for, or None where the controller answers it
        before its results are read (not joined, not alive, a key that may not send it)."""
        self._take = take
        """A merged TaskResults' Outcome, result i charged to member i (None: handling it raised)."""
        self._deliver = deliver
        """The replies of held requests that an Outcome's events answer."""

    def replies(self, polled: Iterable[Polled]) -> Iterator[tuple[bytes, m.Msg]]:
        """The replies to one poll's messages, in the order they can be sent."""
        run = _Run()
        for ident, principal, msg in polled:
            part = _part(msg)
            member = None if part is None else self._sender(ident, cast("m.Msg", msg), principal)
            if member is not None and part is not None:
                run.add(ident, principal, cast("Results", msg), member, part)
                if len(run.members) >= MAX_MERGED:
                    yield from self._flush(run)
                    run = _Run()
                continue
            if ident in run.idents:  # what the member sent before this is answered before it
                yield from self._flush(run)
                run = _Run()
            yield from self._dispatch(ident, msg, principal)
        yield from self._flush(run)

    def _flush(self, run: _Run) -> Iterator[tuple[bytes, m.Msg]]:
        if len(run.msgs) <= 1:
            for ident, principal, msg in run.msgs:
                yield from self._dispatch(ident, msg, principal)
            return
        done = self._take(run.members, run.joined())
        if done is None:  # the group rolled back: each message gets the answer a failed handler gives
            for ident, _principal, msg in run.msgs:
                yield ident, m.Error(rid=msg.rid, code="internal", message="handling the result failed")
            return
        reply = done.reply
        if not isinstance(reply, m.ResultsAck) or len(reply.acks) != len(run.members):
            # refused whole (nothing was stored): each message gets the answer it gets alone
            for ident, principal, msg in run.msgs:
                yield from self._dispatch(ident, msg, principal)
            return
        k = 0
        for ident, _principal, msg in run.msgs:
            if isinstance(msg, m.TaskResult):
                yield ident, _answer(msg, reply.acks[k])
                k += 1
            else:
                yield ident, m.ResultsAck(rid=msg.rid, acks=reply.acks[k : k + len(msg.results)])
                k += len(msg.results)
        yield from self._deliver(done)


class _Run:
    """Results messages waiting to be taken together, and their results in order with each one's
    member."""

    __slots__ = ("idents", "members", "msgs", "parts")

    def __init__(self) -> None:
        self.idents: set[bytes] = set()
        self.msgs: list[tuple[bytes, Principal | None, Results]] = []
        self.parts: list[m.Outcome | ResultColumns] = []
        """Each message's result (a TaskResult's) or its columns (a TaskResults')."""
        self.members: list[dict[str, Any]] = []
        """The member of each result, in order."""

    def add(
        self,
        ident: bytes,
        principal: Principal | None,
        msg: Results,
        member: dict[str, Any],
        part: m.Outcome | ResultColumns,
    ) -> None:
        self.idents.add(ident)
        self.msgs.append((ident, principal, msg))
        self.parts.append(part)
        self.members += [member] * (1 if isinstance(part, m.Outcome) else len(part.heads))

    def joined(self) -> m.TaskResults:
        """The run as one TaskResults: consecutive TaskResults' results packed into columns together,
        and those columns joined with the TaskResults' own (columns.join: no sequence of a
        TaskResults becomes a Python object)."""
        views: list[ResultColumns] = []
        loose: list[m.Outcome] = []
        for part in self.parts:
            if isinstance(part, m.Outcome):
                loose.append(part)
                continue
            if loose:
                views.append(ResultColumns(pack(loose, checked=True)))
                loose = []
            views.append(part)
        if not views:
            return pack(loose, checked=True)
        if loose:
            views.append(ResultColumns(pack(loose, checked=True)))
        return join(views)


def _part(msg: m.Msg | DecodeError) -> m.Outcome | ResultColumns | None:
    """What a results message brings to a run, if it may be merged: a TaskResult's result whose
    sequences fit the columns (not an error: nothing to store; one that does not fit is answered by
    the single-result path, which names its fault), or the columns of a TaskResults of up to SMALL
    results whose columns fit."""
    if type(msg) is m.TaskResult:
        if msg.error:
            return None
        o = m.Outcome(task_id=msg.task_id, epoch=msg.epoch, episodes=msg.episodes)
        return o if columnable(o) else None
    if type(msg) is m.TaskResults and 0 < len(msg.results) <= SMALL:
        view = ResultColumns(msg)
        return None if view.problem else view
    return None


def _answer(msg: m.TaskResult, ack: m.OutcomeAck) -> m.Msg:
    """One merged result's OutcomeAck as the reply its own TaskResult gets alone."""
    if ack.status == "invalid":
        return m.Error(rid=msg.rid, code=ack.code, message=ack.message)
    return m.ResultAck(rid=msg.rid, task_id=ack.task_id, status=ack.status)

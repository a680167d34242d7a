"""Results of one member read in one poll are taken together: the TaskResult messages (one task each)
that a member sent back to back are stored as one TaskResults would be, in one transaction and one
pass of the checks, the advantages and the writes; each message is still answered on its own
(docs/architecture.md, "Group commit").

A message of one task costs the controller about as much as a TaskResults of dozens (its commit, its
reads of the leases and the policies, its stage-state save), so a member that answers each task in its
own message would otherwise get a fraction of the throughput of one that groups them. Only what the
single-result path would answer the same way is merged: a member's consecutive TaskResults, without
another message of the same member between them, whose sequences fit the columns. Anything the merged
handling refuses as a whole (an unknown member, a refused key, an internal error) is handled again one
message at a time, so every message gets exactly the answer it would have got alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError
from astraflow.protocol.columns import columnable
from astraflow.roles.controller.outcome import Outcome
from astraflow.transport.principal import Principal

MAX_MERGED = 256
"""Most TaskResult messages taken as one (a member's longer run is taken in several)."""

Polled = tuple[bytes, Principal | None, m.Msg | DecodeError]
Replies = list[tuple[bytes, m.Msg]]


class Coalescer:
    """Walks one poll's messages in order: a member's TaskResult messages wait in its run until
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
        runs: dict[bytes, tuple[Principal | None, list[m.TaskResult]]] = {}
        for ident, principal, msg in polled:
            run = runs.get(ident)
            if type(msg) is m.TaskResult and not msg.error and _fits(msg):
                if run is not None and run[0] != principal:
                    yield from self._flush(ident, *runs.pop(ident))
                    run = None
                if run is None:
                    runs[ident] = run = (principal, [])
                run[1].append(msg)
                if len(run[1]) >= MAX_MERGED:
                    yield from self._flush(ident, *runs.pop(ident))
                continue
            if run is not None:  # what the member sent before this is answered before it
                yield from self._flush(ident, *runs.pop(ident))
            yield from self._dispatch(ident, msg, principal)
        for ident, run in runs.items():
            yield from self._flush(ident, *run)

    def _flush(
        self, ident: bytes, principal: Principal | None, run: list[m.TaskResult]
    ) -> Iterator[tuple[bytes, m.Msg]]:
        if len(run) == 1:
            yield from self._dispatch(ident, run[0], principal)
            return
        merged = m.TaskResults.of(
            [m.Outcome(task_id=r.task_id, epoch=r.epoch, episodes=r.episodes) for r in run]
        )
        done = self._handle(ident, merged, principal)
        reply = done.reply
        if not isinstance(reply, m.ResultsAck) or len(reply.acks) != len(run):
            # refused whole (nothing was stored): each message gets the answer it gets alone
            for msg in run:
                yield from self._dispatch(ident, msg, principal)
            return
        for msg, ack in zip(run, reply.acks, strict=True):
            yield ident, _answer(msg, ack)
        yield from self._deliver(done)


def _fits(msg: m.TaskResult) -> bool:
    """Whether every sequence of the result can be a slice of the columns (one that cannot is
    answered by the single-result path, which names its fault)."""
    return all(columnable(s) for ep in msg.episodes for s in ep.sequences)


def _answer(msg: m.TaskResult, ack: m.OutcomeAck) -> m.Msg:
    """One merged result's OutcomeAck as the reply its own TaskResult gets alone."""
    if ack.status == "invalid":
        return m.Error(rid=msg.rid, code=ack.code, message=ack.message)
    return m.ResultAck(rid=msg.rid, task_id=ack.task_id, status=ack.status)

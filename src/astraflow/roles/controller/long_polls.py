"""Long polls as subscriptions: a held request is handled again when an event that can change its
answer happens, or at its deadline.

The handlers say what changed by returning an `Outcome` with its `Event`s (a result accepted, a batch
served, a version recorded, the run's members or controls changed; outcome.py); each event names the
held requests it may answer (`SUBSCRIBERS`). The loop (service.py) delivers the events a message
caused once it is handled, and the deadlines every tick. Handling a held request again may cause
events in turn (a batch served makes room for tasks); those are delivered in the same pass. What is
held, and for how long, is roles/controller/parked.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from astraflow.protocol import messages as m
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.parked import Parked, ParkedRequests, may_park

__all__ = ["SUBSCRIBERS", "Answer", "Event", "LongPolls", "MayBeReady"]

SUBSCRIBERS: dict[Event, tuple[tuple[str, ...], bool]] = {
    Event.RESULT_ACCEPTED: (("batch",), False),
    Event.BATCH_SERVED: (("task",), False),
    Event.VERSION_RECORDED: (("task",), True),
    Event.RUN_CHANGED: (("batch", "task"), True),
}
"""Event -> (the kinds of held requests it may answer, whether each is answered whatever its answer)."""

Answer = Callable[[Parked], Outcome]
"""Handles a held request again, without its wait (the controller's own handling)."""
MayBeReady = Callable[[Parked], bool]
"""A cheap check that a held BatchRequest is worth handling again."""


class LongPolls:
    """The held requests, answered when the events that concern them come (or at their deadlines)."""

    def __init__(self) -> None:
        self.parked = ParkedRequests()

    def hold(
        self, ident: bytes, principal: object, msg: object, reply: m.Msg | None, now: float
    ) -> m.Msg | None:
        """The reply to send now for a handled request: None if it was parked (a long poll with
        nothing to answer yet); a request that is answered supersedes a held one of its kind."""
        if not isinstance(msg, m.BatchRequest | m.TaskRequest):
            return reply
        if may_park(msg, reply):
            self.parked.park(ident, principal, msg, now)
            return None
        # a newer request of the same kind supersedes a held one (its sender stopped waiting)
        held = self.parked.batches if isinstance(msg, m.BatchRequest) else self.parked.tasks
        held.pop(ident, None)
        return reply

    def deliver(
        self, events: Iterable[Event], now: float, answer: Answer, ready: MayBeReady
    ) -> list[tuple[bytes, m.Msg]]:
        """Answer the held requests these events (of one message) subscribe to; the replies to send."""
        out: list[tuple[bytes, m.Msg]] = []
        for event in dict.fromkeys(events):  # each event once, in the order it first happened
            if not self.parked:
                break
            kinds, answer_all = SUBSCRIBERS[event]
            out += self.wake(kinds, now, answer, ready, answer_all=answer_all)
        return out

    def wake(
        self,
        kinds: tuple[str, ...],
        now: float,
        answer: Answer,
        ready: MayBeReady,
        *,
        expired_only: bool = False,
        answer_all: bool = False,
    ) -> list[tuple[bytes, m.Msg]]:
        """Handle held requests of these kinds again; returns the replies to send (a request whose
        answer is still "nothing yet" stays held until its deadline, unless `answer_all`). Events the
        answers cause add the kinds they subscribe to, under the same flags."""
        out: list[tuple[bytes, m.Msg]] = []
        queue = list(kinds)
        while queue:
            kind = queue.pop(0)
            expired, rest = self.parked.take(kind, now, everything=answer_all)
            if expired_only:
                self.parked.put_back(rest)
                rest = []
            if kind == "batch":
                # a batch cannot be ready before enough fresh sequences are buffered: one COUNT, not a batch attempt
                maybe = [p for p in rest if ready(p)]
                self.parked.put_back([p for p in rest if p not in maybe])
                rest = maybe
            keep: list[Parked] = []
            for p in expired + rest:
                done = answer(p)
                reply = done.reply
                if p in rest and reply is not None and may_park(p.msg, reply):
                    keep.append(p)
                    continue
                if reply is not None:
                    out.append((p.ident, reply))
                queue += _follow_ups(done.events, queue)
            self.parked.put_back(keep)
        return out


def _follow_ups(events: tuple[Event, ...], queue: list[str]) -> list[str]:
    """The kinds these events (of one answer) subscribe to that are not queued yet."""
    extra: list[str] = []
    for event in events:
        for kind in SUBSCRIBERS[event][0]:
            if kind not in queue and kind not in extra:
                extra.append(kind)
    return extra

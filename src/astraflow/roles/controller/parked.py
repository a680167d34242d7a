"""Long polls: requests the controller answers later, as soon as their answer can change.

A trainer's `BatchRequest` and a worker's `TaskRequest` may carry `wait_s`. When the controller has
nothing for them yet (the batch is not ready, no task may be leased), it parks the request instead of
answering "retry after RETRY_S", and handles it again when an event may change the answer (which
events answer which requests is long_polls.py). At the deadline it answers with whatever the answer
is then. A parked request writes nothing: it is handled
from scratch when it is answered, so its reply still follows the commit of what it tells.

Polling at RETRY_S cost up to that long per hand-off (batch ready -> trainer, version -> workers),
several times per step; a long poll costs nothing while waiting and answers within one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from astraflow.protocol import messages as m

MAX_WAIT_S = 2.0
"""Longest a request is held, whatever it asks (well inside every member's request timeout)."""


@dataclass
class Parked:
    """One held request: who sent it, with which key, and until when it may wait."""

    ident: bytes
    principal: Any
    msg: m.BatchRequest | m.TaskRequest
    deadline: float


def may_park(msg: m.Msg, reply: m.Msg | None) -> bool:
    """Whether `reply` is a "nothing yet, retry" answer to a request that asked to wait."""
    if isinstance(msg, m.BatchRequest) and isinstance(reply, m.BatchReply):
        return msg.wait_s > 0 and not reply.ready and not reply.done
    if isinstance(msg, m.TaskRequest) and isinstance(reply, m.TaskGrant):
        return msg.wait_s > 0 and not reply.tasks and not reply.stop
    return False


def immediate(msg: m.BatchRequest | m.TaskRequest) -> m.BatchRequest | m.TaskRequest:
    """The same request without the wait: what handling a parked request again answers."""
    return msgspec.structs.replace(msg, wait_s=0.0)


class ParkedRequests:
    """At most one held request per member and kind (a newer one replaces the older)."""

    def __init__(self) -> None:
        self.batches: dict[bytes, Parked] = {}
        self.tasks: dict[bytes, Parked] = {}

    def park(self, ident: bytes, principal: Any, msg: m.BatchRequest | m.TaskRequest, now: float) -> None:
        """Hold `msg` until an event or its deadline (its wait_s, capped at MAX_WAIT_S)."""
        held = self.batches if isinstance(msg, m.BatchRequest) else self.tasks
        held[ident] = Parked(ident, principal, msg, now + min(float(msg.wait_s), MAX_WAIT_S))

    def held_rids(self, ident: bytes) -> tuple[int, ...]:
        """The rids of this member's held requests (at most one per kind)."""
        return tuple(p.msg.rid for p in (self.batches.get(ident), self.tasks.get(ident)) if p is not None)

    def drop(self, ident: bytes) -> None:
        """Forget what a member had parked (it sent a newer request of the same kind, or left)."""
        self.batches.pop(ident, None)
        self.tasks.pop(ident, None)

    def take(self, kind: str, now: float, *, everything: bool = False) -> tuple[list[Parked], list[Parked]]:
        """Remove and return (expired, the rest) of one kind ("batch" or "task"); `everything`: all of
        them count as expired (answered whatever the answer is)."""
        held = self.batches if kind == "batch" else self.tasks
        items = list(held.values())
        held.clear()
        expired = [p for p in items if everything or p.deadline <= now]
        rest = [p for p in items if not (everything or p.deadline <= now)]
        return expired, rest

    def put_back(self, items: list[Parked]) -> None:
        """Hold again requests whose answer is still "nothing yet" (unless a newer one came meanwhile)."""
        for p in items:
            held = self.batches if isinstance(p.msg, m.BatchRequest) else self.tasks
            held.setdefault(p.ident, p)

    def __len__(self) -> int:
        return len(self.batches) + len(self.tasks)

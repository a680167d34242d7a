"""What handling one message comes to: the reply, and the events it caused.

The handlers (members.py, tasks.py, results.py, batches.py, versions.py) read and write the store and
the controller's state and return an `Outcome`; they never send anything nor touch the held requests.
The IO side (service.py) sends the reply and hands the events to the long polls (long_polls.py), which
answer the held requests each event may concern.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from astraflow.protocol import messages as m


class Event(Enum):
    """What a handler changed that a held request may be waiting on."""

    RESULT_ACCEPTED = "result_accepted"
    """A result was stored: a held BatchRequest may now be ready."""
    BATCH_SERVED = "batch_served"
    """A batch (or a part of one) went to its trainer: admission may have room for more tasks."""
    VERSION_RECORDED = "version_recorded"
    """A new version: every held TaskRequest is answered, so its worker hears of it and pulls it."""
    RUN_CHANGED = "run_changed"
    """A member left or drains, or an operator paused, resumed or stopped: every held request is answered."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The reply to one message and what its handling changed (in memory only; not the wire's
    `messages.Outcome`, one result of a TaskResults)."""

    reply: m.Msg | None
    """What to send back (None: nothing; a held request's reply comes later)."""
    events: tuple[Event, ...] = ()
    """What changed that held requests may wait on, in the order it happened."""
    void: bytes | None = None
    """A member whose held requests are void: it joined afresh (its client already failed them) or
    left; the IO side forgets them before it answers any held request."""

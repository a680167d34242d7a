"""Heartbeats: the rate limit, and an idle member's beat handled from memory and answered only when
there is news.

Ten thousand members beating every 0.5 s send the controller 20,000 messages a second, nearly all of
them idle: no lease to renew, no request waiting, no new error. Such a beat (`Beats.idle`) is taken
before the general routing (service.py `dispatch`): it passes the member's rate limit, times the member
in the member table (memory; no SQLite write, roles/member_table.py) and is answered only when the
member must learn something: versions it was not told of yet (`PolicyVersions.generation`; at most
one such answer every NEWS_EVERY_S), that the run stops, or that ACK_EVERY_S passed since its last
answer (a member dials again when it has heard nothing for transport/member_loop.REOPEN_AFTER_S). Every other beat takes the general path
(`Beats.handle`, members.on_heartbeat), which renews leases, records a new error, names lost requests
and always answers; so does the first beat after a Hello, any beat of a member whose row the
controller does not hold in memory, and every beat of a run with `[weights] relays` (each answer
names the relays of the member's region).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from astraflow.protocol import messages as m
from astraflow.roles.controller.outcome import Outcome
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.run_end import RunEnd
from astraflow.roles.member_table import MemberTable
from astraflow.transport.principal import Principal

ACK_EVERY_S = 2.0
"""Longest time an idle member goes without an answer to its beats (well inside the member's
REOPEN_AFTER_S, 6 s, after which it dials again)."""
NEWS_EVERY_S = 1.0
"""Shortest time between two answers that bring an idle member new versions: versions recorded many
times a second reach it as one answer a second, the newest (a worker that leases tasks hears of each
at once: the version answers its held task request)."""
BURST = 20.0
"""Heartbeats a member may send at once before the rate limit applies."""
PER_S = 5.0
"""Sustained heartbeats allowed per member (4 per interval if the recipe's is shorter than 0.8 s)."""
RATE_LIMITED = "heartbeats too fast: nothing recorded"
"""The message of the Error that answers a heartbeat over the rate limit."""

Replies = list[tuple[bytes, m.Msg]]
"""What `dispatch` returns: (member, reply) to send."""


@dataclass(slots=True)
class Beat:
    """What the controller keeps of one live member's heartbeats."""

    member_id: str
    tokens: float = BURST
    """The rate limit's token bucket: beats the member may send now."""
    last: float = 0.0
    """When the bucket was last counted."""
    error: str = ""
    """The error its beats carried when the general path last took one (already recorded)."""
    generation: int = -1
    """The versions' generation it was last told (-1: none)."""
    answered: float = 0.0
    """When one of its beats was last answered."""


class Beats:
    """Every live member's `Beat`, the idle beats' fast path and the general path's wrapper."""

    def __init__(
        self,
        members: MemberTable,
        versions: PolicyVersions,
        run: RunEnd,
        on_heartbeat: Callable[..., Outcome],
        *,
        heartbeat_interval_s: float,
    ) -> None:
        self.members = members
        self.versions = versions
        self.run = run
        self.on_heartbeat = on_heartbeat
        """members.on_heartbeat with its parts (service.py): the general path."""
        self.per_s = max(PER_S, 4.0 / heartbeat_interval_s)
        """Sustained heartbeats allowed per member."""
        self.beats: dict[bytes, Beat] = {}
        """Member (as its socket identity) -> its Beat; dropped when it joins afresh, leaves or dies."""

    def allowed(self, beat: Beat, now: float) -> bool:
        """The rate limit, a token bucket per member: BURST at once, `per_s` sustained."""
        tokens = beat.tokens
        if now > beat.last:  # a clock stepped back refills nothing and takes nothing
            tokens += (now - beat.last) * self.per_s
        beat.last = now
        if tokens > BURST:
            tokens = BURST
        if tokens < 1.0:
            beat.tokens = tokens
            return False
        beat.tokens = tokens - 1.0
        return True

    def idle(self, ident: bytes, msg: m.Heartbeat, principal: Principal | None, now: float) -> Replies | None:
        """The replies to an idle member's beat ([] when it has nothing to learn), or None when the
        beat takes the general path (see the module's docstring)."""
        beat = self.beats.get(ident)
        if beat is None or not self._is_idle(beat, msg, principal):
            return None
        mid = beat.member_id
        if not self.allowed(beat, now):
            return [(ident, m.Error(rid=msg.rid, code="rate_limited", message=RATE_LIMITED))]
        slots = msg.busy + msg.free
        self.members.touch(mid, now, msg.loaded or None, slots if slots > 0 else None)
        stop = self.run.stopping()
        generation = self.versions.generation
        quiet = now - beat.answered
        if not stop and 0.0 <= quiet < (ACK_EVERY_S if beat.generation == generation else NEWS_EVERY_S):
            return []
        beat.generation, beat.answered = generation, now
        return [(ident, m.HeartbeatAck(rid=msg.rid, versions=self.versions.latest(), stop=stop))]

    def _is_idle(self, beat: Beat, msg: m.Heartbeat, principal: Principal | None) -> bool:
        """Whether the fast path may take this beat of a live member (see the module's docstring)."""
        if msg.active or msg.waiting or self.versions.relays or (msg.error and msg.error != beat.error):
            return False
        mid = beat.member_id
        if principal is not None and principal.name != mid:
            return False  # the general path refuses it
        row = self.members.rows.get(mid)  # the kept row: as the general path reads it
        return row is not None and row["status"] == "alive" and mid in self.members.seen

    def handle(
        self, ident: bytes, member: dict[str, Any], msg: m.Heartbeat, *, held: Collection[int], now: float
    ) -> Outcome:
        """The general path: the rate limit, then members.on_heartbeat, whose answer tells the member
        the versions."""
        beat = self.beats.get(ident)
        if beat is None:
            beat = self.beats[ident] = Beat(str(member["id"]), last=now)
        if not self.allowed(beat, now):
            return Outcome(m.Error(rid=msg.rid, code="rate_limited", message=RATE_LIMITED))
        generation = self.versions.generation
        done = self.on_heartbeat(member, msg, held=held)
        beat.error = msg.error  # recorded by on_heartbeat when it was new
        if isinstance(done.reply, m.HeartbeatAck):
            beat.generation, beat.answered = generation, now
        return done

    def forget(self, ident: bytes) -> None:
        """A member joined afresh, left or died: what was kept of its beats goes."""
        self.beats.pop(ident, None)

"""Heartbeats: the rate limit, and an idle member's beat handled from memory and answered only when
there is news.

Nearly every beat of a big pool is idle: no lease to renew, no request waiting that the controller
does not hold (a long poll it holds is fine), no new error. Idle members beat less often
(beat_pace.py: all of them together at most `controller.idle_beats_per_s` a second), and such a beat
(`Beats.idle`) is taken before the general routing (service.py `dispatch`): it passes the member's
rate limit, times the member in the member table, in the timeout lane its `next_beat_s` asks for
(memory; no SQLite write, roles/member_table.py) and is answered only when the member must learn
something: versions it was not told of yet (`PolicyVersions.generation`; at most one such answer
every NEWS_EVERY_S), that the run stops, a new idle interval, or that ACK_EVERY_S (or ACK_BEATS of
the member's announced intervals, if longer) passed since its last answer (a member that beats every
10 s gets an answer to every other beat; it dials again only after hearing nothing for several of its
own intervals, transport/member_loop.py). Every other
beat takes the general path (`Beats.handle`, members.on_heartbeat), which renews leases, records a
new error, names lost requests and always answers; so does the first beat after a Hello, any beat of
a member whose row the controller does not hold in memory, and every beat of a run with `[weights]
relays` (each answer names the relays of the member's region).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from astraflow.protocol import messages as m
from astraflow.roles.controller.beat_pace import IDLE_MAX_S, BeatPace, timeout_scale
from astraflow.roles.controller.outcome import Outcome
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.run_end import RunEnd
from astraflow.roles.member_table import MemberTable
from astraflow.transport.principal import Principal

ACK_EVERY_S = 2.0
"""Longest time an idle member goes without an answer to its beats (well inside what the member waits
before it dials again: transport/member_loop.py), unless ACK_BEATS of its intervals are longer."""
ACK_BEATS = 1.5
"""An idle member that beats less often is answered once this many of its announced intervals passed
since its last answer: every other beat (each answer is a message on its connection)."""
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
    told: float = 0.0
    """The idle interval it was last told (0: none yet)."""


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
        pace: BeatPace,
        held: Callable[[bytes], Collection[int]],
    ) -> None:
        self.members = members
        self.versions = versions
        self.run = run
        self.on_heartbeat = on_heartbeat
        """members.on_heartbeat with its parts (service.py): the general path."""
        self.heartbeat_interval_s = heartbeat_interval_s
        self.pace = pace
        """The idle interval members are told (beat_pace.py)."""
        self.held = held
        """Member (socket identity) -> the rids of its requests the controller holds (long polls)."""
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
        row = None if beat is None else self._idle_row(ident, beat, msg, principal)
        if beat is None or row is None:
            return None
        mid = beat.member_id
        if not self.allowed(beat, now):
            return [(ident, m.Error(rid=msg.rid, code="rate_limited", message=RATE_LIMITED))]
        slots = msg.busy + msg.free
        self.members.touch(mid, now, msg.loaded or None, slots if slots > 0 else None)
        self.members.pace(mid, timeout_scale(msg.next_beat_s, self.heartbeat_interval_s))
        stop = self.run.stopping()
        generation = self.versions.generation
        told = self.pace.for_role(row["role"])
        quiet = now - beat.answered
        wait = NEWS_EVERY_S
        if beat.generation == generation:
            gap = msg.next_beat_s if msg.next_beat_s <= IDLE_MAX_S else IDLE_MAX_S  # also NaN
            wait = max(ACK_EVERY_S, ACK_BEATS * gap)
        if not stop and told == beat.told and 0.0 <= quiet < wait:
            return []
        beat.generation, beat.answered, beat.told = generation, now, told
        ack = m.HeartbeatAck(rid=msg.rid, versions=self.versions.latest(), stop=stop, idle_interval_s=told)
        return [(ident, ack)]

    def _idle_row(
        self, ident: bytes, beat: Beat, msg: m.Heartbeat, principal: Principal | None
    ) -> dict[str, Any] | None:
        """The member's kept row when the fast path may take this beat of it (see the module's
        docstring), else None."""
        if msg.active or self.versions.relays or (msg.error and msg.error != beat.error):
            return None
        if msg.waiting:
            held = self.held(ident)
            if any(rid not in held for rid in msg.waiting):
                return None  # the general path names the ones it never got
        mid = beat.member_id
        if principal is not None and principal.name != mid:
            return None  # the general path refuses it
        row = self.members.rows.get(mid)  # the kept row: as the general path reads it
        if row is None or row["status"] != "alive" or mid not in self.members.seen:
            return None
        return row

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
        # a member with leases is timed as one that beats at the recipe's interval whatever it says
        scale = 1.0 if msg.active else timeout_scale(msg.next_beat_s, self.heartbeat_interval_s)
        self.members.pace(beat.member_id, scale)
        if isinstance(done.reply, m.HeartbeatAck):
            told = self.pace.for_role(member["role"])
            done.reply.idle_interval_s = told
            beat.generation, beat.answered, beat.told = generation, now, told
        return done

    def forget(self, ident: bytes) -> None:
        """A member joined afresh, left or died: what was kept of its beats goes."""
        self.beats.pop(ident, None)

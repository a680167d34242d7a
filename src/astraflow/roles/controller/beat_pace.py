"""How often an idle member beats: the interval the controller tells its members, set so that all idle
members together send at most `controller.idle_beats_per_s` heartbeats a second.

A member that holds nothing the run waits on (no lease, no request the controller does not hold, no
new error to report) beats every `idle_interval(N)` seconds, N the live members: at least the
recipe's heartbeat_interval_s, at most IDLE_MAX_S. A busy member beats at heartbeat_interval_s. Each
Heartbeat says when the next one comes (`next_beat_s`), and the controller declares a member dead
after the same number of missed beats: member_timeout_s × its interval / heartbeat_interval_s
(`timeout_scale`; roles/member_table.py keeps one timing lane per scale). What an idle member's
longer interval costs: its death is noticed later, which loses nothing, since it holds no lease.

The told interval changes only when the membership moves the rule's value by more than CHANGE (a
member joining or leaving does not make every idle beat an answer); members learn the new one from
the Welcome and from the answers their beats already get (beats.py).
"""

from __future__ import annotations

import math

IDLE_MAX_S = 60.0
"""The longest idle interval the controller tells, and the longest `next_beat_s` it believes."""
CHANGE = 0.25
"""Relative change of the rule's value past which members are told a new idle interval."""
LANES_PER_DOUBLING = 4
"""Timeout scales are rounded up to 2**(k / LANES_PER_DOUBLING): the member table keeps a few timing
lanes, whatever intervals members claim."""


def idle_interval(members: int, heartbeat_interval_s: float, idle_beats_per_s: float) -> float:
    """The idle interval the rule gives for `members` live members."""
    return min(IDLE_MAX_S, max(heartbeat_interval_s, members / idle_beats_per_s))


def timeout_scale(next_beat_s: float, heartbeat_interval_s: float) -> float:
    """How many member_timeout_s a member that beats again in `next_beat_s` gets before it is dead:
    its interval over the recipe's, at least 1, at most IDLE_MAX_S's, rounded up to a lane."""
    if not next_beat_s > heartbeat_interval_s:  # also 0 (the default) and NaN
        return 1.0
    ratio = min(next_beat_s, IDLE_MAX_S) / heartbeat_interval_s
    return float(2.0 ** (math.ceil(LANES_PER_DOUBLING * math.log2(ratio) - 1e-9) / LANES_PER_DOUBLING))


class BeatPace:
    """The idle interval told to members now, updated as the membership changes."""

    def __init__(self, heartbeat_interval_s: float, idle_beats_per_s: float) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.idle_beats_per_s = idle_beats_per_s
        self.told = heartbeat_interval_s
        """The idle interval members are told (Welcome, HeartbeatAck)."""

    def update(self, members: int) -> float:
        """The idle interval for `members` live members: the one told so far, unless the rule's value
        moved by more than CHANGE from it (then that value, told from now on)."""
        want = idle_interval(members, self.heartbeat_interval_s, self.idle_beats_per_s)
        if abs(want - self.told) > CHANGE * self.told:
            self.told = want
        return self.told

    def for_role(self, role: str) -> float:
        """The idle interval told to a member of `role`: a trainer always beats at the recipe's
        interval (one per policy; its silence is what lets another trainer of the policy join)."""
        return self.heartbeat_interval_s if role == "trainer" else self.told

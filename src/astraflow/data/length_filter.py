"""length_filter: drop groups with over-long or truncated sequences.

Turn-aware: a sequence is bad when one of its policy turns was truncated (hit max_new_tokens without a
stop token, if `drop_truncated`), when it generated more than `max_length` tokens over all its turns,
or when one turn generated more than `max_turn_length`. A multi-turn sequence whose turns all ended
normally is not truncated, however long the conversation. A group is dropped when more than
`max_bad_fraction` of its sequences are bad (0 = any bad sequence drops the group). Filters see whole
groups, so a single sequence is never removed from a group: that would change its advantages.
"""

from __future__ import annotations

from pydantic import Field

from astraflow.data.base import GroupFilter, GroupView, StageConfig


class LengthFilterConfig(StageConfig):
    """Options of the length filter."""

    drop_truncated: bool = True
    """Count sequences that hit max_new_tokens without a stop token as bad."""
    max_length: int | None = Field(None, ge=1)
    """Count sequences with more generated tokens (all turns together) than this as bad (None = no limit)."""
    max_turn_length: int | None = Field(None, ge=1)
    """Count sequences with a policy turn longer than this as bad (None = no limit)."""
    max_bad_fraction: float = Field(0.0, ge=0, lt=1)
    """Drop the group when the fraction of bad sequences exceeds this."""


class LengthFilter(GroupFilter):
    """Drops groups whose share of truncated or over-long sequences is too high."""

    Config = LengthFilterConfig
    config: LengthFilterConfig
    counters = ("kept", "filtered", "truncated", "overlong")

    def keep(self, group: GroupView) -> bool:
        """False when more than max_bad_fraction of the sequences are truncated or over-long."""
        cfg = self.config
        n = max(len(group.lengths), len(group.truncated))
        bad = 0
        for i in range(n):
            trunc = i < len(group.truncated) and group.truncated[i]
            over = cfg.max_length is not None and i < len(group.lengths) and group.lengths[i] > cfg.max_length
            if cfg.max_turn_length is not None and i < len(group.turn_lengths):
                over = over or any(t > cfg.max_turn_length for t in group.turn_lengths[i])
            self.counts["truncated"] += trunc
            self.counts["overlong"] += over
            bad += (trunc and cfg.drop_truncated) or over
        ok = n == 0 or bad / n <= cfg.max_bad_fraction
        self.counts["kept" if ok else "filtered"] += 1
        return ok

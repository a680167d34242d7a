"""format_filter: drop groups whose workflow reported badly formatted answers.

Each sequence's info (GroupView.info[i], the episode's info) may carry a flag, `format_ok` by
default. A sequence is badly formatted when the flag is present and false (or absent, with
`missing = "bad"`). A group is dropped when more than `max_bad_fraction` of its sequences are bad.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from astraflow.data.base import GroupFilter, GroupView, StageConfig


class FormatFilterConfig(StageConfig):
    """Options of the format filter."""

    key: str = "format_ok"
    """Info key of the per-sequence format flag (true = well formatted)."""
    missing: Literal["ok", "bad"] = "ok"
    """How a sequence without the key counts."""
    max_bad_fraction: float = Field(0.0, ge=0, lt=1)
    """Drop the group when the fraction of badly formatted sequences exceeds this."""


class FormatFilter(GroupFilter):
    """Drops groups with too many badly formatted sequences."""

    Config = FormatFilterConfig
    config: FormatFilterConfig
    counters = ("kept", "filtered", "bad_format")

    def is_bad(self, info: dict[str, Any]) -> bool:
        """Whether one sequence's info says its format was bad."""
        if self.config.key not in info:
            return self.config.missing == "bad"
        return not info[self.config.key]

    def keep(self, group: GroupView) -> bool:
        """False when more than max_bad_fraction of the sequences are badly formatted."""
        n = max(len(group.rewards), len(group.info))
        infos = list(group.info) + [{}] * (n - len(group.info))
        bad = sum(self.is_bad(info) for info in infos)
        self.counts["bad_format"] += bad
        ok = n == 0 or bad / n <= self.config.max_bad_fraction
        self.counts["kept" if ok else "filtered"] += 1
        return ok

"""An example third-party astraflow data stage: drop groups whose prompt key matches a pattern."""

from __future__ import annotations

import re
from typing import Any

from pydantic import field_validator

from astraflow.data.base import GroupFilter, GroupView, StageConfig


class KeyPatternConfig(StageConfig):
    """Options of the key_pattern filter."""

    pattern: str = ""
    """Regular expression searched in each group's prompt key; empty keeps everything."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value


class KeyPatternFilter(GroupFilter):
    """Drops groups whose prompt key matches `pattern`."""

    Config = KeyPatternConfig
    config: KeyPatternConfig

    def __init__(self, config: KeyPatternConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self._re = re.compile(self.config.pattern) if self.config.pattern else None
        self.counts = {"kept": 0, "filtered": 0}

    def keep(self, group: GroupView) -> bool:
        """False when the group's prompt key matches the pattern."""
        ok = self._re is None or self._re.search(group.prompt_key) is None
        self.counts["kept" if ok else "filtered"] += 1
        return ok

    def state_dict(self) -> dict[str, Any]:
        """The counters."""
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.counts = {k: int(v) for k, v in state["counts"].items()}

    def metrics(self) -> dict[str, float]:
        """kept, filtered (groups, cumulative)."""
        return {k: float(v) for k, v in self.counts.items()}

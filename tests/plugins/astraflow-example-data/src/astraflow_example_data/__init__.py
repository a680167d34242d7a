"""Example third-party astraflow plugins: a data stage that drops groups whose prompt key matches a
pattern, and a workflow whose environment crashes on some prompts (for failure-handling tests)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import field_validator

from astraflow.data.base import GroupFilter, GroupView, StageConfig
from astraflow.workflows.quickstart import QuickstartConfig, QuickstartWorkflow


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

    counters = ("kept", "filtered")

    def __init__(self, config: KeyPatternConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self._re = re.compile(self.config.pattern) if self.config.pattern else None

    def keep(self, group: GroupView) -> bool:
        """False when the group's prompt key matches the pattern."""
        ok = self._re is None or self._re.search(group.prompt_key) is None
        self.counts["kept" if ok else "filtered"] += 1
        return ok


class FlakyConfig(QuickstartConfig):
    """The quickstart's options plus which prompts break."""

    fail_pattern: str = "-3$"
    """Episodes of prompts whose id matches this regular expression raise an error."""


class FlakyWorkflow(QuickstartWorkflow):
    """The quickstart, except that some prompts always crash their episode (a buggy environment)."""

    Config = FlakyConfig
    config: FlakyConfig

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, Any]) -> Any:
        """Raise for the prompts fail_pattern names, else play the quickstart episode."""
        if re.search(self.config.fail_pattern, str(sample.get("id", ""))):
            raise RuntimeError(f"environment crashed on {sample.get('id')}")
        return await super().run_episode(sample, policies)

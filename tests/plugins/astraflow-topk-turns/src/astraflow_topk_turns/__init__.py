"""A workflow that overrides top-k on every policy turn of a two-turn transcript (a test plugin)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from astraflow.workflows.base import Episode, PolicyClient
from astraflow.workflows.quickstart.workflow import QuickstartConfig, QuickstartWorkflow, score
from astraflow.workflows.transcript import Transcript


class TopKTurnsConfig(QuickstartConfig):
    """The quickstart's options, and the top-k every policy turn is sampled with."""

    top_k: int = Field(5, ge=1)
    """Per-call top-k override of both turns."""


class TopKTurnsWorkflow(QuickstartWorkflow):
    """Answer, read a masked separator, answer again; the reward scores the first answer."""

    Config = TopKTurnsConfig

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Two policy turns of one raw transcript, both with `top_k` overridden."""
        actor = policies["actor"]
        k = int(getattr(self.config, "top_k", 5))
        tr = Transcript(actor, chat=False)
        tr.add_text(str(sample["prompt"]))
        first = await tr.generate(top_k=k)
        tr.add_text(" ; again =")
        await tr.generate(top_k=k)
        words = first.text.split()
        reward = score(words, not first.truncated, str(sample["answer"]).split())
        return Episode(sequences=[tr.sequence(reward)], info={"turns": float(len(tr.turns))})

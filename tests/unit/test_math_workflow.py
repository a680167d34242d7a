"""The math workflow: data loaders per format, the verifier pool's kill-on-timeout, real math-verify."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from astraflow.engines.base import Completion
from astraflow.errors import AstraflowError
from astraflow.models.bpe import build_bpe_tokenizer
from astraflow.protocol.messages import SamplingParams
from astraflow.workflows.common.verifier_pool import VerifierPool
from astraflow.workflows.math.data import last_boxed, load_math, normalize
from astraflow.workflows.math.workflow import MathConfig, MathWorkflow

ROWS = {
    "gsm8k": {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    "math": {"problem": "Compute $1/2 + 1/4$.", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
    "deepscaler": {"problem": "Find $x$ if $2x=1$.", "answer": "\\frac{1}{2}", "solution": "..."},
}


def test_each_format_normalizes_to_question_and_gold_answer() -> None:
    assert normalize(ROWS["gsm8k"])["answer"] == "7"
    assert normalize(ROWS["math"])["answer"] == "\\frac{3}{4}"
    assert normalize(ROWS["deepscaler"])["question"].startswith("Find")
    assert last_boxed("a \\boxed{x^{2}} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    with pytest.raises(AstraflowError, match="no final answer"):
        normalize({"question": "q", "answer": ""})
    with pytest.raises(AstraflowError, match="no question"):
        normalize({"answer": "1"})


def test_jsonl_and_parquet_files_load(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [ROWS["gsm8k"], ROWS["math"], ROWS["deepscaler"]]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist([ROWS["deepscaler"]] * 2), tmp_path / "d.parquet")
    assert [r["answer"] for r in load_math(tmp_path / "d.jsonl")] == ["7", "\\frac{3}{4}", "\\frac{1}{2}"]
    assert len(load_math(tmp_path / "d.parquet")) == 2
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(AstraflowError, match="bad.jsonl:2"):
        load_math(tmp_path / "bad.jsonl")
    wf = MathWorkflow(MathConfig(data_file=str(tmp_path / "d.jsonl")))
    assert len(list(wf.dataset(seed=0))) == 3


def test_verifier_pool_kills_an_overrunning_call_and_keeps_serving() -> None:
    pool = VerifierPool("time:sleep", workers=1, timeout_s=0.5)

    async def go() -> tuple[Any, Any, int, int]:
        first = pool._workers[0].process.pid
        slow = await pool.call(30)
        fast = await pool.call(0)
        return slow, fast, first, pool._workers[0].process.pid

    try:
        slow, fast, before, after = asyncio.run(go())
    finally:
        pool.close()
    assert not slow.ok and slow.error == "timeout" and pool.timeouts == 1
    assert fast.ok
    # The worker stuck in the 30 s sleep was killed and replaced.
    assert after != before
    with pytest.raises(ProcessLookupError):
        os.kill(before, 0)


def test_preloaded_modules_are_imported_before_the_first_call_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target that imports a slow module lazily: its first call overruns a short timeout unless the
    module is preloaded, when the import is part of the worker's start, not of the call."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(2.0)\n")
    (tmp_path / "lazy_target.py").write_text("def check():\n    import slow_import\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path

    def first_call(preload: tuple[str, ...]) -> Any:
        pool = VerifierPool("lazy_target:check", workers=1, timeout_s=1.0, preload=preload)
        try:
            return asyncio.run(pool.call())
        finally:
            pool.close()

    assert first_call(()).error == "timeout"
    preloaded = first_call(("slow_import",))
    assert preloaded.ok and preloaded.value == 1.0


def test_math_verify_scores_equivalent_answers_through_the_pool() -> None:
    pool = VerifierPool("astraflow.workflows.math.reward:boxed_reward", workers=1, timeout_s=30)

    async def go() -> list[Any]:
        cases = [
            ("so \\boxed{0.5}", "\\frac{1}{2}"),
            ("\\boxed{\\frac{2}{4}}", "0.5"),
            ("\\boxed{8}", "7"),
            ("the answer is 7", "7"),
        ]
        return [await pool.call(c, g) for c, g in cases]

    try:
        results = asyncio.run(go())
    finally:
        pool.close()
    assert [tuple(r.value) for r in results] == [(1.0, True), (1.0, True), (0.0, True), (0.0, False)]


class ScriptedClient:
    """A fake PolicyClient (named so): answers with fixed text."""

    policy = "main"

    def __init__(self, tokenizer: Any, answer: str) -> None:
        self.tokenizer = tokenizer
        self.answer = answer
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        ids = list(self.tokenizer.encode(self.answer, add_special_tokens=False)) + [
            self.tokenizer.eos_token_id
        ]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop", SamplingParams())]


def test_episode_rewards_the_verified_answer(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("Q: What is 3 + 4?\nA: \\boxed{7}\n")
    tok = build_bpe_tokenizer(tmp_path / "c.txt", 270)
    wf = MathWorkflow(MathConfig(prompt="raw", raw_template="{question} = \\boxed{{", verifier_workers=1))
    sample = {"id": "a", "question": "add 3 + 4", "answer": "7"}
    try:
        right = asyncio.run(wf.run_episode(sample, {"actor": ScriptedClient(tok, "7}")}))
        wrong = asyncio.run(wf.run_episode(sample, {"actor": ScriptedClient(tok, "8}")}))
    finally:
        wf.pool().close()
    assert right.sequences[0].reward == 1.0 and right.info["correct"] == 1.0
    assert wrong.sequences[0].reward == 0.0 and wrong.info["boxed"] == 1.0
    seq = right.sequences[0]
    assert seq.turns is not None and len(seq.turns) == 1 and sum(seq.loss_mask) == seq.turns[0][1]


def test_closing_the_workflow_stops_its_verifier_processes() -> None:
    wf = MathWorkflow(MathConfig(verifier_workers=2))
    wf.close()  # nothing started: nothing to do
    pids = [w.process.pid for w in wf.pool()._workers]
    assert all(w.process.is_alive() for w in wf.pool()._workers)
    wf.close()  # what the RaaS calls as it stops
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

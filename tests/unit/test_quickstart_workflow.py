"""The quickstart workflow: its prompts, its partial-credit reward and the episode it returns."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from astraflow.engines.base import Completion
from astraflow.models.init import build_tokenizer
from astraflow.protocol.messages import SamplingParams
from astraflow.workflows.quickstart.workflow import QuickstartConfig, QuickstartWorkflow, make_sample, score


class ScriptedClient:
    """A PolicyClient that answers with fixed tokens."""

    policy = "main"

    def __init__(self, tokenizer: Any, answer: str, stop: bool) -> None:
        self.tokenizer = tokenizer
        ids = tokenizer.encode(answer, add_special_tokens=False)
        self.ids = ids + ([tokenizer.eos_token_id] if stop else [])
        self.calls: list[tuple[list[int], int]] = []

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        self.calls.append((list(prompt_ids), n))
        k = len(self.ids)
        return [Completion(self.ids, [-0.5] * k, [3] * k, "stop", SamplingParams()) for _ in range(n)]


def test_samples_per_task() -> None:
    assert make_sample("copy", [3, 1, 4], 3) == ("copy 3 1 4 =", "3 1 4")
    assert make_sample("reverse", [3, 1, 4], 3) == ("reverse 3 1 4 =", "4 1 3")
    assert make_sample("add", [4, 7, 1, 5], 2) == ("add 4 7 + 1 5 =", "6 2")
    assert make_sample("add", [9, 9, 0, 5], 2) == ("add 9 9 + 0 5 =", "1 0 4")


def test_dataset_is_deterministic_and_sized() -> None:
    wf = QuickstartWorkflow(QuickstartConfig(task="copy", length=3, size=50))
    a, b = list(wf.dataset(seed=1)), list(wf.dataset(seed=1))
    assert a == b and len(a) == 50
    assert a != list(wf.dataset(seed=2))
    assert len(list(wf.dataset(seed=1, size=7))) == 7
    for s in a:
        words = s["prompt"].split()
        assert words[0] == "copy" and words[-1] == "=" and s["answer"] == " ".join(words[1:-1])
        assert len(s["answer"].split()) == 3
    assert len({s["id"] for s in a}) == 50


def test_defaults_are_the_tuned_quickstart() -> None:
    cfg = QuickstartConfig()
    assert (cfg.task, cfg.length, cfg.reward) == ("copy", 2, "partial")
    with pytest.raises(ValidationError):
        QuickstartConfig(task="sort")
    with pytest.raises(ValidationError):
        QuickstartConfig(colour="red")


def test_partial_credit_by_hand() -> None:
    answer = ["3", "1", "4"]
    assert score(["3", "1", "4"], True, answer) == 1.0
    assert score(["3", "1", "4"], False, answer) == 0.75  # no stop after the answer
    assert score(["3", "9", "4"], True, answer) == 0.75
    assert score(["3"], True, answer) == 0.25  # stopped too early: only position 1 right
    assert score(["3", "1", "4", "4"], True, answer) == 0.75  # too long: the stop is misplaced
    assert score([], False, answer) == 0.0
    assert score(["3", "9", "4"], True, answer, exact=True) == 0.0
    assert score(["3", "1", "4"], True, answer, exact=True) == 1.0


@pytest.mark.parametrize(
    ("reply", "stop", "reward"), [("3 1 4", True, 1.0), ("3 1 5", True, 0.75), ("3 1 4", False, 0.75)]
)
def test_episode_sequence_is_aligned_and_scored(reply: str, stop: bool, reward: float) -> None:
    tok = build_tokenizer()
    client = ScriptedClient(tok, reply, stop)
    wf = QuickstartWorkflow(QuickstartConfig(task="copy", length=3))
    sample = {"id": "copy-0", "prompt": "copy 3 1 4 =", "answer": "3 1 4"}
    ep = asyncio.run(wf.run_episode(sample, {"actor": client}))
    (seq,) = ep.sequences
    prompt_ids = tok.encode(sample["prompt"])
    assert client.calls == [(prompt_ids, 1)]
    n, k = len(prompt_ids), len(client.ids)
    assert seq.policy == "main"
    assert seq.tokens == prompt_ids + client.ids
    assert seq.loss_mask == [0] * n + [1] * k
    assert seq.logprobs == [0.0] * n + [-0.5] * k
    assert seq.versions == [-1] * n + [3] * k
    assert seq.reward == pytest.approx(reward)
    assert ep.info["correct"] == (1.0 if reward == 1.0 else 0.0)


def test_group_is_one_n_sample_call_scored_like_episodes() -> None:
    tok = build_tokenizer()
    client = ScriptedClient(tok, "3 1 5", True)
    wf = QuickstartWorkflow(QuickstartConfig(task="copy", length=3))
    sample = {"id": "copy-0", "prompt": "copy 3 1 4 =", "answer": "3 1 4"}
    group = asyncio.run(wf.run_group(sample, {"actor": client}, {"actor": 5}))
    single = asyncio.run(wf.run_episode(sample, {"actor": client}))
    prompt_ids = tok.encode(sample["prompt"])
    assert client.calls == [(prompt_ids, 5), (prompt_ids, 1)]
    assert len(group) == 5
    for ep in group:
        assert ep.sequences == single.sequences and ep.info == single.info
        assert ep.sequences[0].reward == pytest.approx(0.75)


def test_workflow_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, astraflow.workflows.quickstart.workflow; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"

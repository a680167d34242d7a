"""The multi-turn toolkit: transcripts against a real engine, turn metadata, tools off the event loop."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from astraflow.data.base import GroupView
from astraflow.data.length_filter import LengthFilter, LengthFilterConfig
from astraflow.data.turns import sequence_turns
from astraflow.engines.base import Completion
from astraflow.models.init import init_model
from astraflow.protocol.codec import decode, encode
from astraflow.protocol.messages import Episode, SamplingParams, Sequence, TaskResult
from astraflow.workflows.common.tools import Tools
from astraflow.workflows.transcript import Transcript, TranscriptError, TranscriptFull

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chat")
    (d / "corpus.txt").write_text("What is 2 plus 2? The answer is 4.\nsearch the tool result\n" * 10)
    return init_model("qwen3", "tiny", d / "m", tokenizer="bpe", corpus=d / "corpus.txt", vocab_size=300)


def _client(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from astraflow.engines.torch_engine import TorchEngine
    from astraflow.roles.policy_client import EnginePolicyClient

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = TorchEngine(str(model_dir), seed=0, device="cpu")
    sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)
    return EnginePolicyClient("main", tok, engine, sampling, [tok.eos_token_id])


def test_chat_transcript_records_engine_tokens_and_rescores_exactly(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    client = _client(model_dir)

    async def episode() -> Transcript:
        tr = Transcript(client, chat=True)
        tr.add_message("user", "What is 2 plus 2?")
        await tr.generate()
        tr.add_message("tool", "result: 4")
        await tr.generate(max_new_tokens=3)
        return tr

    try:
        tr = asyncio.run(episode())
    finally:
        client.engine.close()
    seq = tr.sequence(reward=1.0)
    assert len(seq.tokens) == len(seq.loss_mask) == len(seq.logprobs) == len(seq.versions)
    assert seq.turns is not None and len(seq.turns) == 2
    # Masked everywhere except the two policy turns, which hold the engine's exact ids.
    trainable = [i for i, m in enumerate(seq.loss_mask) if m]
    spans = [i for s, n, _ in seq.turns for i in range(s, s + n)]
    assert trainable == spans
    assert all(
        seq.versions[i] == -1 and seq.logprobs[i] == 0.0 for i in range(len(seq.tokens)) if i not in spans
    )
    # The second turn was capped at 3 tokens; a turn without a stop token is truncated.
    assert seq.turns[1][1] <= 3
    for s, n, trunc in seq.turns:
        assert trunc == (client.tokenizer.eos_token_id not in seq.tokens[s : s + n] and n in (3, 6))
    # The environment message sits between the turns and is the template's rendering of it.
    text = client.tokenizer.decode(seq.tokens)
    assert "<|im_start|>tool\nresult: 4<eos>\n<|im_start|>assistant\n" in text
    # Recorded behaviour logprobs equal the model's own on the recorded tokens (no re-tokenization).
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq.tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    for i in trainable:
        assert abs(float(logp[i - 1, seq.tokens[i]]) - seq.logprobs[i]) < 1e-4


class ScriptedClient:
    """A fake PolicyClient (named so): answers each call with the next scripted completion."""

    policy = "main"

    def __init__(self, tokenizer: Any, answers: list[tuple[str, bool]]) -> None:
        self.tokenizer = tokenizer
        self.answers = list(answers)
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=50)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        text, stop = self.answers.pop(0)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        ids += [self.tokenizer.eos_token_id] if stop else []
        return [
            Completion(
                ids, [-0.25] * len(ids), [7] * len(ids), "stop" if stop else "length", SamplingParams()
            )
        ]


def test_chat_transcript_equals_the_template_of_the_whole_conversation(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = ScriptedClient(tok, [("search 2 plus 2", True), ("The answer is 4.", True)])

    async def episode() -> Transcript:
        tr = Transcript(client, chat=True)
        tr.add_message("system", "Use tools.")
        tr.add_message("user", "What is 2 plus 2?")
        t1 = await tr.generate()
        assert t1.text == "search 2 plus 2" and not t1.truncated
        tr.add_message("tool", "4")
        await tr.generate()
        return tr

    tr = asyncio.run(episode())
    seq = tr.sequence(1.0)
    # Each call saw the transcript so far; the final tokens render exactly as the template would.
    assert client.prompts[1] == seq.tokens[: len(client.prompts[1])]
    assert tok.decode(seq.tokens) == tok.apply_chat_template(tr.messages, tokenize=False).rstrip("\n")
    assert [m["role"] for m in tr.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert not tr.truncated and seq.turns == [(t.start, t.length, False) for t in tr.turns]


def test_raw_mode_budget_overrides_and_sampling_consistency(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = ScriptedClient(tok, [("4 4 4 4", False), ("x", True)])

    async def episode() -> None:
        tr = Transcript(client, chat=False, max_tokens=12)
        tr.add_text("2+2=", special_tokens=True)
        turn = await tr.generate()
        assert turn.truncated
        with pytest.raises(TranscriptError, match="unknown sampling override"):
            await tr.generate(temprature=0.5)
        tr.add_ids([5] * (12 - len(tr.tokens)))
        with pytest.raises(TranscriptFull):
            await tr.generate()
        with pytest.raises(TranscriptError, match="different settings"):
            tr.add_completion(Completion([9], [-1.0], [7], "stop", SamplingParams(temperature=0.5)))

    asyncio.run(episode())
    with pytest.raises(TranscriptError, match="add_message is for chat"):
        Transcript(client, chat=False).add_message("user", "x")


def test_turns_survive_the_wire_and_drive_the_length_filter() -> None:
    # Two policy turns of 5 tokens that ended with a stop token: 10 generated tokens in all.
    seq = Sequence(
        policy="main",
        tokens=list(range(16)),
        loss_mask=[0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0],
        logprobs=[0.0] * 16,
        versions=[0] * 16,
        turns=[(2, 5, False), (10, 5, False)],
        sampling=SamplingParams(),
    )
    msg = decode(encode(TaskResult(task_id=1, epoch=0, episodes=[Episode(sequences=[seq])])))
    assert isinstance(msg, TaskResult)
    back = msg.episodes[0].sequences[0]
    assert back.turns == [(2, 5, False), (10, 5, False)]
    max_new = 8
    turns = sequence_turns(back, max_new)
    assert [t.length for t in turns] == [5, 5] and not any(t.truncated for t in turns)
    # Without recorded turns the mask runs give the same turns.
    assert sequence_turns(Sequence(**{**_fields(seq), "turns": None}), max_new) == turns
    # The old rule (all generated tokens >= max_new_tokens) would call this sequence truncated.
    view = GroupView(
        task_id=1,
        prompt_key="k",
        policy="main",
        rewards=[1.0],
        advantages=[0.0],
        lengths=[10],
        truncated=[any(t.truncated for t in turns)],
        turn_lengths=[[t.length for t in turns]],
        turn_truncated=[[t.truncated for t in turns]],
    )
    assert LengthFilter(LengthFilterConfig()).keep(view)
    assert not LengthFilter(LengthFilterConfig(max_turn_length=4)).keep(view)
    truncated = Sequence(**{**_fields(seq), "turns": [(2, 5, False), (10, 5, True)]})
    assert sequence_turns(truncated, max_new)[1].truncated


def _fields(seq: Sequence) -> dict[str, Any]:
    return {f: getattr(seq, f) for f in seq.__struct_fields__}


def test_sync_tool_runs_off_the_event_loop_with_a_timeout() -> None:
    tools = Tools({"slow": lambda s: time.sleep(s) or "slept", "boom": lambda: 1 / 0}, timeout_s=5.0)

    async def fast(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    tools.register("double", fast)

    async def scenario() -> tuple[int, Any, Any, Any, Any, Any]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.ensure_future(ticker())
        slept = await tools.call("slow", 0.5)
        timed_out = await tools.call("slow", 5.0, timeout_s=0.2)
        t.cancel()
        return (
            ticks,
            slept,
            timed_out,
            await tools.call("double", 21),
            await tools.call("boom"),
            await tools.call("nope"),
        )

    try:
        ticks, slept, timed_out, doubled, boom, unknown = asyncio.run(scenario())
    finally:
        tools.close()
    # The loop kept running while the sync tool slept (a blocking call would allow ~1 tick).
    assert ticks >= 10
    assert slept.ok and slept.value == "slept"
    assert not timed_out.ok and timed_out.error == "timeout"
    assert doubled.ok and doubled.value == 42
    assert not boom.ok and "ZeroDivisionError" in boom.text()
    assert not unknown.ok and "unknown_tool" in unknown.error
    assert threading.active_count() >= 1


def test_controller_rejects_turns_that_do_not_fit_the_sequence() -> None:
    from astraflow.config.recipe import Recipe
    from astraflow.data.turns import turns_problem
    from astraflow.dataflow.validate import ResultChecker

    # the controller's own result check (no model dir here: token ids are checked for >= 0 only)
    checker = ResultChecker(
        Recipe.model_validate({"policy": [{"name": "main", "model": "no-such-model-dir"}]})
    )

    def why(seq: Sequence) -> str:
        return checker.check(
            [Episode(sequences=[seq])],
            expected={"main": 1},
            roles={"r": "main"},
            latest={"main": 0},
        )

    base = _fields(
        Sequence(
            policy="main",
            tokens=[1, 2, 3, 4],
            loss_mask=[0, 1, 1, 0],
            logprobs=[0.0] * 4,
            versions=[-1, 0, 0, -1],
            sampling=SamplingParams(),
        )
    )
    good = Sequence(**{**base, "turns": [(1, 2, False)]})
    assert turns_problem(good) == "" and why(good) == ""
    outside = Sequence(**{**base, "turns": [(3, 5, False)]})
    masked = Sequence(**{**base, "turns": [(0, 2, False)]})
    assert "outside" in why(outside)
    assert "loss_mask 0" in why(masked)

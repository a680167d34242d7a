"""Bring your own agent: the real `openai` client against a per-episode loopback endpoint served by a
real TorchEngine; the recorded tokens must be the engine's own output, and the endpoint must refuse
anyone without the episode's key. Also the env-server protocol against the real reference server."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from astraflow.engines.base import Completion, GenerationRequest
from astraflow.errors import AstraflowError
from astraflow.models.init import init_model
from astraflow.workflows.env_protocol import EnvServerConfig, EnvServerWorkflow
from astraflow.workflows.openai_agent import AgentEndpoint, OpenAIAgentConfig, OpenAIAgentWorkflow

openai = pytest.importorskip("openai")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("agent")
    (d / "corpus.txt").write_text(
        "What is 2 plus 2? The answer is 4.\nSay the word apple river stone.\n" * 10
    )
    return init_model("qwen3", "tiny", d / "m", tokenizer="bpe", corpus=d / "corpus.txt", vocab_size=300)


class RecordingEngine:
    """The real TorchEngine; every prompt it was given and every completion it returned is kept."""

    def __init__(self, model_dir: Path) -> None:
        from astraflow.engines.torch_engine import TorchEngine

        self.inner = TorchEngine(str(model_dir), seed=0, device="cpu")
        self.calls: list[tuple[list[int], Completion]] = []

    async def generate(self, reqs: list[GenerationRequest]) -> list[Completion]:
        outs = await self.inner.generate(reqs)
        self._keep(reqs, outs)
        return outs

    async def generate_n(self, req: GenerationRequest, n: int) -> list[Completion]:
        outs = await self.inner.generate_n(req, n)
        self._keep([req] * n, outs)
        return outs

    def _keep(self, reqs: list[GenerationRequest], outs: list[Completion]) -> None:
        # copies: what the engine returned, before anyone downstream could touch it
        for r, c in zip(reqs, outs, strict=True):
            self.calls.append(
                (
                    list(r.prompt_ids),
                    Completion(list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason),
                )
            )


def _client(model_dir: Path) -> tuple[Any, RecordingEngine]:
    from transformers import AutoTokenizer

    from astraflow.roles.raas import EnginePolicyClient

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = RecordingEngine(model_dir)
    sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=6)
    return EnginePolicyClient("main", tok, engine, sampling, [tok.eos_token_id]), engine  # type: ignore[arg-type]


def _workflow() -> OpenAIAgentWorkflow:
    return OpenAIAgentWorkflow(OpenAIAgentConfig(agent="unused:agent", max_tokens=200))


def test_openai_client_agent_records_the_engines_exact_tokens(model_dir: Path) -> None:
    client, engine = _client(model_dir)
    seen: dict[str, Any] = {}

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> float:
        oai = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": task["q"]}]
        first = oai.chat.completions.create(model="any-name", messages=msgs, logprobs=True)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content}]
        msgs += [{"role": "user", "content": "Say the word apple."}]
        second = oai.chat.completions.create(model=ep.model, messages=msgs, max_tokens=4, n=2)
        # the completions endpoint, prompted by token ids, extended with the engine's ids
        third = oai.completions.create(model=ep.model, prompt=[1, 5, 6, 7], max_tokens=3, logprobs=1)
        seen.update(first=first, second=second, third=third, url=ep.base_url, key=ep.api_key)
        # another local process without the key, or with another key, is refused
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=ep.base_url, api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model=ep.model, messages=msgs)
        with pytest.raises(openai.BadRequestError, match="stream"):
            oai.chat.completions.create(model=ep.model, messages=msgs, stream=True)
        with pytest.raises(openai.BadRequestError, match="tools"):
            oai.chat.completions.create(
                model=ep.model, messages=msgs, tools=[{"type": "function", "function": {"name": "f"}}]
            )
        return 0.5

    async def main() -> Any:
        wf = _workflow()
        ep, reward = await wf.run_agent({"q": "What is 2 plus 2?"}, {"actor": client}, agent)
        # the episode is over: its key no longer works
        after = openai.AsyncOpenAI(base_url=seen["url"], api_key=seen["key"], max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await after.chat.completions.create(model="actor", messages=[{"role": "user", "content": "hi"}])
        await wf.server.close()
        return ep, reward

    try:
        ep, reward = asyncio.run(main())
    finally:
        engine.inner.close()
    assert reward == 0.5 and ep.requests == 3 + 2  # 3 served, 2 refused with 400 (401s never reach it)
    seqs = ep.sequences(reward)
    # chat: turn 1 then two branches of turn 2 (n=2) -> two Sequences of two turns; completions -> one
    chat = [s for s in seqs if s.turns and len(s.turns) == 2]
    raw = [s for s in seqs if s.turns and len(s.turns) == 1]
    assert len(chat) == 2 and len(raw) == 1 and len(seqs) == 3
    gen = engine.calls
    assert len(gen) == 1 + 2 + 1
    for seq, (prompt2, out2) in zip(chat, gen[1:3], strict=True):
        (s1, n1, _), (s2, n2, _) = seq.turns
        prompt1, out1 = gen[0]
        # the engine was prompted with exactly the recorded ids before each turn ...
        assert seq.tokens[:s1] == prompt1 and seq.tokens[:s2] == prompt2
        # ... and the recorded policy tokens, logprobs and versions are the engine's own output
        assert seq.tokens[s1 : s1 + n1] == out1.token_ids and seq.tokens[s2 : s2 + n2] == out2.token_ids
        assert seq.logprobs[s1 : s1 + n1] == out1.logprobs and seq.logprobs[s2 : s2 + n2] == out2.logprobs
        assert seq.versions[s2 : s2 + n2] == out2.versions
        assert [i for i, m in enumerate(seq.loss_mask) if m] == [*range(s1, s1 + n1), *range(s2, s2 + n2)]
        assert seq.reward == 0.5
    # the first turn's returned logprobs are the engine's
    lp = [x.logprob for x in seen["first"].choices[0].logprobs.content]
    assert lp == pytest.approx(gen[0][1].logprobs)
    ((s, n, _),) = raw[0].turns
    assert raw[0].tokens[:s] == [1, 5, 6, 7] == gen[3][0] and raw[0].tokens[s : s + n] == gen[3][1].token_ids
    assert seen["third"].choices[0].logprobs.token_logprobs == pytest.approx(gen[3][1].logprobs)


def test_stop_strings_cut_the_record_at_the_engines_tokens(model_dir: Path) -> None:
    from astraflow.workflows.openai_endpoint import cut_at_stop

    client, engine = _client(model_dir)
    tok = client.tokenizer
    try:
        out = asyncio.run(
            client.generate(tok.encode("Say the word", add_special_tokens=False), max_new_tokens=6)
        )[0]
    finally:
        engine.inner.close()
    text = tok.decode(out.token_ids, skip_special_tokens=True)
    if len(text.strip()) < 2:
        pytest.skip("the random model produced too little text to cut")
    stop = text.strip()[1:3] if len(text.strip()) >= 3 else text.strip()[-1]
    cut, before = cut_at_stop(tok, out, [stop])
    assert before is not None and stop not in before and text.startswith(before)
    k = len(cut.token_ids)
    assert (
        cut.token_ids == out.token_ids[:k]
        and cut.logprobs == out.logprobs[:k]
        and cut.finish_reason == "stop"
    )
    assert stop in tok.decode(cut.token_ids, skip_special_tokens=True)
    assert stop not in tok.decode(cut.token_ids[:-1], skip_special_tokens=True)


def test_agent_without_a_numeric_reward_fails_clearly(model_dir: Path) -> None:
    client, engine = _client(model_dir)
    wf = _workflow()

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> str:
        return "no reward here"

    wf._fns["agent"] = agent

    async def main() -> None:
        with pytest.raises(AstraflowError, match="not a number"):
            await wf.run_episode({}, {"actor": client})
        await wf.server.close()

    try:
        asyncio.run(main())
    finally:
        engine.inner.close()


def test_env_server_protocol_against_the_reference_server(model_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "astraflow.workflows.env_reference", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    client, engine = _client(model_dir)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        wf = EnvServerWorkflow(EnvServerConfig(url=url, max_turns=2, max_tokens=200))
        samples = list(wf.dataset(0, 3))

        async def play() -> list[Any]:
            return list(await asyncio.gather(*(wf.run_episode(s, {"actor": client}) for s in samples)))

        episodes = asyncio.run(play())
        for ep in episodes:
            (seq,) = ep.sequences
            assert seq.turns and 1 <= len(seq.turns) <= 2 and seq.reward in (0.0, 0.5, 1.0)
            assert ep.info["env_turns"] == len(seq.turns)
        bad = EnvServerWorkflow(EnvServerConfig(url=url + "/nope", max_turns=1))
        with pytest.raises(AstraflowError, match="HTTP 404"):
            asyncio.run(bad.run_episode(samples[0], {"actor": client}))
    finally:
        engine.inner.close()
        proc.terminate()
        proc.wait(timeout=10)

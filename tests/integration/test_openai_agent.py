"""Bring your own agent: the real `openai` client against a per-episode loopback endpoint served by a
real TorchEngine; the recorded tokens must be the engine's own output, and the endpoint must refuse
anyone without the episode's key. Also the env-server protocol against the real reference server.
Over 400 lines because its tests share the module's model and the tool-tuned model made from it (a
few dozen Adam steps), which a split would build twice."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import json
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
from astraflow.workflows.env_protocol.workflow import EnvServerConfig, EnvServerWorkflow
from astraflow.workflows.openai.agent import AgentEndpoint, OpenAIAgentConfig, OpenAIAgentWorkflow
from astraflow.workflows.openai.tool_calls import forced_ids

openai = pytest.importorskip("openai")
torch.set_num_threads(1)
TOOL_CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("agent")
    (d / "corpus.txt").write_text(
        "What is 2 plus 2? The answer is 4.\nSay the word apple river stone.\n" * 10
        + f"Tools (call as {TOOL_CALL_TEXT}):\n" * 5
    )
    return init_model("qwen3", "tiny", d / "m", tokenizer="bpe", corpus=d / "corpus.txt", vocab_size=400)


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
                    Completion(
                        list(c.token_ids),
                        list(c.logprobs),
                        list(c.versions),
                        c.finish_reason,
                        c.sampling,
                    ),
                )
            )


def _client(model_dir: Path) -> tuple[Any, RecordingEngine]:
    from transformers import AutoTokenizer

    from astraflow.roles.policy_client import EnginePolicyClient

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = RecordingEngine(model_dir)
    sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)
    return EnginePolicyClient("main", tok, engine, sampling, [tok.eos_token_id]), engine  # type: ignore[arg-type]


def _workflow() -> OpenAIAgentWorkflow:
    return OpenAIAgentWorkflow(OpenAIAgentConfig(agent="unused:agent", max_tokens=200))


def _run_agent(client: Any, engine: Any, agent: Any) -> Any:
    """One episode of `agent` on an empty task through the endpoint; the engine is closed afterwards."""

    async def main() -> Any:
        wf = _workflow()
        ep, _ = await wf.run_agent({}, {"actor": client}, agent)
        await wf.server.close()
        return ep

    try:
        return asyncio.run(main())
    finally:
        engine.inner.close()


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
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            oai.chat.completions.create(model=ep.model, messages=msgs, logprobs=True, top_logprobs=2)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            oai.chat.completions.create(
                model=ep.model,
                messages=msgs,
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
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
    from astraflow.workflows.openai.endpoint import cut_at_stop

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
        [sys.executable, "-m", "astraflow.workflows.env_protocol.reference", "--port", "0"],
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


def _policy_turns(seq: Any) -> list[list[int]]:
    return [seq.tokens[s : s + n] for s, n, _ in seq.turns]


def test_streamed_answers_are_recorded_exactly_as_streamed(model_dir: Path) -> None:
    client, engine = _client(model_dir)
    tok = client.tokenizer
    got: dict[str, Any] = {}

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> float:
        oai = ep.openai()
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 plus 2?"}]
        chunks = list(
            oai.chat.completions.create(
                model=ep.model,
                messages=msgs,
                stream=True,
                logprobs=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got["chat"] = chunks, text
        # the agent sends the streamed text back: the conversation extends the recorded trajectory
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Say the word apple."}]
        list(oai.chat.completions.create(model=ep.model, messages=msgs, stream=True, max_tokens=3))
        got["raw"] = list(
            oai.completions.create(
                model=ep.model, prompt="Say the word", stream=True, logprobs=1, max_tokens=5
            )
        )
        return 1.0

    ep = _run_agent(client, engine, agent)
    (p1, out1), (p2, out2), (p3, out3) = engine.calls
    chunks, text = got["chat"]
    eos = tok.eos_token_id
    body1 = out1.token_ids[:-1] if out1.token_ids[-1] == eos else out1.token_ids
    # what was streamed is the text of the engine's tokens, with the engine's logprobs ...
    assert text == tok.decode(body1)
    streamed_lp = [
        x.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.content
    ]
    assert streamed_lp == pytest.approx(out1.logprobs)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        out1.finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == len(out1.token_ids) and chunks[
        -1
    ].usage.prompt_tokens == len(p1)
    # ... and what is recorded is the engine's own output: one chat Sequence of two turns, one raw
    chat, raw = ep.sequences(1.0)
    assert _policy_turns(chat) == [out1.token_ids, out2.token_ids] and p2[: len(p1)] == p1
    assert chat.tokens[: len(p2)] == p2 and chat.versions[len(p2) :] == out2.versions
    assert [chat.logprobs[i] for i, m in enumerate(chat.loss_mask) if m] == out1.logprobs + out2.logprobs
    assert _policy_turns(raw) == [out3.token_ids] and raw.tokens[: len(p3)] == p3
    raw_text = "".join(c.choices[0].text for c in got["raw"])
    body3 = out3.token_ids[:-1] if out3.token_ids[-1] == eos else out3.token_ids
    assert raw_text == tok.decode(body3, skip_special_tokens=True)
    raw_lp = [x for c in got["raw"] if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert raw_lp == pytest.approx(out3.logprobs)


@pytest.fixture(scope="module")
def tool_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model fine-tuned (a few dozen Adam steps) to answer "What is 2 plus 2?" with a tool call,
    so that the real engine generates one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 2?"}],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    p_ids = tok.encode(prompt, add_special_tokens=False)
    ids = torch.tensor([p_ids + tok.encode(TOOL_CALL_TEXT + "<eos>", add_special_tokens=False)])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    out = tmp_path_factory.mktemp("tool") / "m"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


TOOLS = [{"type": "function", "function": {"name": "add"}}]


def test_tool_calls_round_trip_through_the_real_engine(tool_model_dir: Path) -> None:
    client, engine = _client(tool_model_dir)
    tok = client.tokenizer
    got: dict[str, Any] = {}

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> float:
        oai = ep.openai()
        msgs: list[Any] = [{"role": "user", "content": "What is 2 plus 2?"}]
        first = oai.chat.completions.create(
            model=ep.model, messages=msgs, tools=TOOLS, temperature=0.2, max_tokens=40
        )
        call = first.choices[0].message.tool_calls[0]
        # as agent frameworks do: the returned message object, then the tool's result
        msgs += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "4"}]
        oai.chat.completions.create(model=ep.model, messages=msgs, tools=TOOLS, temperature=0.2, max_tokens=4)
        stream = oai.chat.completions.create(
            model=ep.model, messages=msgs[:1], tools=TOOLS, temperature=0.2, max_tokens=40, stream=True
        )
        got.update(first=first, chunks=list(stream))
        return 1.0

    ep = _run_agent(client, engine, agent)
    (p1, out1), (p2, out2), (p3, out3) = engine.calls
    # the engine really generated the tool call (the fine-tune took), and the endpoint parsed it
    assert tok.decode(out1.token_ids) == TOOL_CALL_TEXT + "<eos>"
    choice = got["first"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 2}
    # the template rendered the tools; the tool result extended the recorded ids (not re-tokenized)
    first_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 2?"}],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert p1 == tok.encode(first_prompt, add_special_tokens=False)
    tool_turn = tok.encode("\n<|im_start|>tool\n4<eos>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert p2 == p1 + out1.token_ids + tool_turn
    seqs = ep.sequences(1.0)
    two = [s for s in seqs if len(s.turns or []) == 2]
    assert len(seqs) == 2 and len(two) == 1
    assert _policy_turns(two[0]) == [out1.token_ids, out2.token_ids] and two[0].sampling.temperature == 0.2
    # streamed, the same call arrives as a tool_calls delta
    deltas = [tc for c in got["chunks"] for tc in (c.choices[0].delta.tool_calls or [])]
    assert out3.token_ids == out1.token_ids and [d.function.name for d in deltas] == ["add"]
    assert json.loads(deltas[0].function.arguments) == {"a": 2, "b": 2}
    assert [c.choices[0].finish_reason for c in got["chunks"]][-1] == "tool_calls"


def test_tool_choice_forces_the_call_opening(tool_model_dir: Path) -> None:
    """A named tool_choice prompts the engine with the opening of that tool's call; the forced tokens
    are context in the trajectory (mask 0), the sampled rest is trained, and the call is parsed."""
    client, engine = _client(tool_model_dir)
    tok = client.tokenizer
    got: dict[str, Any] = {}

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> float:
        oai = ep.openai()
        msgs: list[Any] = [{"role": "user", "content": "What is 2 plus 2?"}]
        named = {"type": "function", "function": {"name": "add"}}
        got["named"] = oai.chat.completions.create(
            model=ep.model, messages=msgs, tools=TOOLS, tool_choice=named, temperature=0.2, max_tokens=40
        )
        got["required"] = oai.chat.completions.create(
            model=ep.model, messages=msgs, tools=TOOLS, tool_choice="required", temperature=0.2, max_tokens=40
        )
        return 1.0

    ep = _run_agent(client, engine, agent)
    (p1, out1), (p2, out2) = engine.calls
    first_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 2?"}],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    base = tok.encode(first_prompt, add_special_tokens=False)
    # forced: the call's opening up to `"arguments":` (the trailing space would merge with what follows)
    assert tok.decode(p1[len(base) :]) == '<tool_call>{"name": "add", "arguments":'
    assert tok.decode(p2[len(base) :]) in ('<tool_call>{"name": "', '<tool_call>{"name":')
    # the fine-tuned model completes the forced opening into the call it learnt
    (call,) = got["named"].choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 2}
    assert got["named"].choices[0].finish_reason == "tool_calls"
    seq = next(s for s in ep.sequences(1.0) if s.tokens[: len(p1)] == p1)
    assert seq.tokens == p1 + out1.token_ids
    assert seq.loss_mask == [0] * len(p1) + [1] * len(out1.token_ids)
    assert tok.decode(seq.tokens[len(base) :]) == TOOL_CALL_TEXT + "<eos>"
    # the forced ids are exactly the leading ids of the whole call's own tokenization
    whole = tok.encode(TOOL_CALL_TEXT, add_special_tokens=False)
    forced = forced_ids(tok, '<tool_call>{"name": "add", "arguments": ')
    assert whole[: len(forced)] == forced == p1[len(base) :]


def test_a_seed_makes_the_engine_repeat_its_samples(model_dir: Path) -> None:
    client, engine = _client(model_dir)
    answers: list[list[str]] = []

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> float:
        oai = ep.openai()
        msgs = [{"role": "user", "content": "Say the word apple."}]
        for _ in range(2):
            out = oai.chat.completions.create(model=ep.model, messages=msgs, seed=7, n=2, max_tokens=8)
            answers.append([c.message.content or "" for c in out.choices])
        return 1.0

    ep = _run_agent(client, engine, agent)
    outs = [c.token_ids for _, c in engine.calls]
    # the same seed gives the same samples; choice i of n uses seed + i, so the two choices differ
    assert answers[0] == answers[1] and outs[:2] == outs[2:] and outs[0] != outs[1]
    assert sorted(_policy_turns(s)[0] for s in ep.sequences(1.0)) == sorted(outs)


def test_per_role_rewards_and_info_reach_sequences_and_metrics(model_dir: Path, tmp_path: Path) -> None:
    """An agent playing two roles through the real openai client returns per-role rewards and extra
    info: each role's trajectories carry its reward and role, and the info reaches the step metrics."""
    from astraflow.config.recipe import PolicyConfig
    from astraflow.dataflow.buffer import Buffer
    from astraflow.dataflow.pipeline import Pipeline
    from astraflow.state.store import Store

    client, engine = _client(model_dir)
    wf = _workflow()

    def agent(ep: AgentEndpoint, task: dict[str, Any]) -> dict[str, Any]:
        oai = ep.openai()
        for role in ("proposer", "solver", "solver"):
            msgs = [{"role": "user", "content": f"{role}: say the word apple."}]
            oai.chat.completions.create(model=role, messages=msgs, max_tokens=3)
        return {"reward": 0.0, "rewards": {"solver": 1.0}, "info": {"correct": True}, "steps": 3}

    wf._fns["agent"] = agent

    async def main() -> Any:
        try:
            return await wf.run_episode({}, {"proposer": client, "solver": client})
        finally:
            await wf.server.close()

    try:
        ep = asyncio.run(main())
    finally:
        engine.inner.close()
    by_role = sorted((s.role, s.reward) for s in ep.sequences)
    assert by_role == [("proposer", 0.0), ("solver", 1.0), ("solver", 1.0)]
    assert ep.info["correct"] == 1.0 and ep.info["steps"] == 3.0
    assert ep.info["trajectories"] == 3.0
    # through the pipeline: numeric info per policy and per role, in the step metrics of its batch
    store = Store.open(tmp_path / "s.db")
    pipe = Pipeline([PolicyConfig(model="m", group_size=3)], seed=0)  # type: ignore[call-arg]
    pipe.ingest(Buffer(store), 7, "k", [ep])
    got = pipe.take_info("main", [7])
    assert (
        got["info/steps"] == 3.0 and got["info/solver/steps"] == 3.0 and got["info/proposer/correct"] == 1.0
    )
    store.close()

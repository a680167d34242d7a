"""The environment-server protocol with tools and under load, against the real reference server process:
tool calls and tool results as their own chat roles, 128 concurrent episodes, retries only where safe,
and errors that say what happened. The policy is a fake (ScriptedPolicy, named so): these tests are
about the protocol, and a random-init model does not produce tool calls."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from astraflow.engines.base import Completion
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams
from astraflow.workflows.env_protocol.reference import BACKLOG, LOOKUP_TOOL, make_server
from astraflow.workflows.env_protocol.workflow import EnvServerConfig, EnvServerError, EnvServerWorkflow
from tests.ports import free_port

torch.set_num_threads(1)
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "k0"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("envtools")
    (d / "corpus.txt").write_text(f"Say the word apple river stone. {CALL}\n" * 10)
    path = init_model("qwen3", "tiny", d / "m", tokenizer="bpe", corpus=d / "corpus.txt", vocab_size=300)
    return AutoTokenizer.from_pretrained(path)


class ScriptedPolicy:
    """A fake PolicyClient (named so): `answer(prompt_text)` gives each turn's text, ended by <eos>."""

    policy = "main"

    def __init__(self, tokenizer: Any, answer: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.answer = answer
        self.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64)
        self.prompts: list[str] = []

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Completion]:
        text = self.tokenizer.decode(prompt_ids)
        self.prompts.append(text)
        ids = [
            *self.tokenizer.encode(self.answer(text), add_special_tokens=False),
            self.tokenizer.eos_token_id,
        ]
        return [Completion(ids, [-0.5] * len(ids), [0] * len(ids), "stop", SamplingParams())]


@pytest.fixture
def reference_server() -> Iterator[Callable[..., str]]:
    """Starts `python -m astraflow.workflows.env_protocol.reference` processes; returns their URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.workflows.env_protocol.reference", "--port", "0", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        return proc.stdout.readline().split()[-1]

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def test_tool_calls_and_results_are_their_own_roles(tokenizer: Any, reference_server: Any) -> None:
    url = reference_server("--game", "lookup")
    policy = ScriptedPolicy(tokenizer, lambda prompt: "apple" if "<|im_start|>tool" in prompt else CALL)
    wf = EnvServerWorkflow(EnvServerConfig(url=url, max_turns=3, max_tokens=1000))
    ep = asyncio.run(wf.run_episode({"index": 0}, {"actor": policy}))
    (seq,) = ep.sequences
    assert seq.reward == 1.0  # looked up first, then answered
    assert ep.info["tool_calls"] == 1.0 and ep.info["env_tool_calls"] == 1.0 and ep.info["turns"] == 2.0
    # The whole sequence is the chat template's rendering of the conversation with tool roles and the
    # tools listed (the template puts the tool result in its own `tool` block, not a user message).
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer with the value."},
            {"role": "user", "content": "What is the value of k0? Use the lookup tool, then say the value."},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "tool_call_id": "x", "name": "lookup", "content": "apple"},
            {"role": "assistant", "content": "apple"},
        ],
        tools=[LOOKUP_TOOL],
        tokenize=False,
    )
    assert tokenizer.decode(seq.tokens) == expected.removesuffix("\n")
    assert (
        "<|im_start|>tool\napple" in policy.prompts[1]
        and "<|im_start|>user" not in policy.prompts[1][len(policy.prompts[0]) :]
    )
    # loss mask: exactly the two policy turns; the tool result is context
    (s1, n1, _), (s2, n2, _) = seq.turns
    assert seq.loss_mask == [
        1 if s1 <= i < s1 + n1 or s2 <= i < s2 + n2 else 0 for i in range(len(seq.tokens))
    ]
    tool_block = tokenizer.decode(seq.tokens[s1 + n1 : s2])
    assert tool_block.startswith("\n<|im_start|>tool\napple")


def test_answering_without_the_tool_and_bad_tool_results(tokenizer: Any, reference_server: Any) -> None:
    url = reference_server("--game", "lookup")
    wf = EnvServerWorkflow(EnvServerConfig(url=url, max_turns=2, max_tokens=1000))
    direct = asyncio.run(
        wf.run_episode({"index": 0}, {"actor": ScriptedPolicy(tokenizer, lambda p: "apple")})
    )
    assert direct.sequences[0].reward == 0.5 and direct.info["tool_calls"] == 0.0
    # a server answering a tool call the policy never made fails the episode clearly
    srv, base = _fault_server(
        {"step": lambda n: {"tool_results": [{"tool_call_id": "nope", "content": "x"}]}}
    )
    try:
        bad = EnvServerWorkflow(EnvServerConfig(url=base, max_turns=2))
        fake_reset = {"session": "s", "observation": "hi", "tools": [LOOKUP_TOOL]}
        srv.answers["reset"] = lambda n: fake_reset
        with pytest.raises(EnvServerError, match="no tool call of this turn"):
            asyncio.run(bad.run_episode({"index": 0}, {"actor": ScriptedPolicy(tokenizer, lambda p: CALL)}))
    finally:
        srv.shutdown()


def test_128_concurrent_episodes(tokenizer: Any, reference_server: Any) -> None:
    url = reference_server()

    def say(prompt: str) -> str:
        return re.findall(r"Say the word (\w+)\.", prompt)[-1]

    policy = ScriptedPolicy(tokenizer, say)
    wf = EnvServerWorkflow(EnvServerConfig(url=url, max_turns=2, max_tokens=400))

    async def play() -> list[Any]:
        return list(
            await asyncio.gather(*(wf.run_episode({"index": i}, {"actor": policy}) for i in range(128)))
        )

    episodes = asyncio.run(play())
    assert len(episodes) == 128 and all(ep.sequences[0].reward == 1.0 for ep in episodes)
    assert make_server(0).request_queue_size == BACKLOG >= 1024


class _FaultServer(ThreadingHTTPServer):
    answers: dict[str, Callable[[int], dict[str, Any] | None]]
    seen: dict[str, int]


def _fault_server(answers: dict[str, Callable[[int], dict[str, Any] | None]]) -> tuple[_FaultServer, str]:
    """A fault-injecting HTTP server (a test fake): `answers[call](n)` for the n-th request of a call
    answers it, or (None) reads the whole request and closes the connection without an answer."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            srv: _FaultServer = self.server  # type: ignore[assignment]
            name = self.path.strip("/")
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            srv.seen[name] = srv.seen.get(name, 0) + 1
            out = srv.answers[name](srv.seen[name])
            if out is None:
                self.close_connection = True
                return
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    srv = _FaultServer(("127.0.0.1", 0), Handler)
    srv.answers, srv.seen = answers, {}
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_only_safe_calls_are_resent_and_errors_say_what_happened() -> None:
    srv, url = _fault_server(
        {"step": lambda n: None, "reward": lambda n: None if n == 1 else {"reward": 1.0}}
    )
    try:
        wf = EnvServerWorkflow(EnvServerConfig(url=url, retries=3, retry_backoff_s=0.0))
        # reward is idempotent: the dropped first answer is asked again
        assert asyncio.run(wf.call("reward", {"session": "s"})) == {"reward": 1.0}
        assert srv.seen["reward"] == 2
        # step may have been carried out: never resent, and no "is the server running?" hint
        with pytest.raises(EnvServerError) as err:
            asyncio.run(wf.call("step", {"session": "s", "action": "a"}))
        assert srv.seen["step"] == 1
        assert "not resent" in str(err.value) and "running" not in str(err.value)
    finally:
        srv.shutdown()
        srv.server_close()
    # nothing listens: every attempt is refused (safe to resend), then the hint
    port = free_port()
    wf = EnvServerWorkflow(EnvServerConfig(url=f"http://127.0.0.1:{port}", retries=2, retry_backoff_s=0.0))
    with pytest.raises(EnvServerError, match=r"connection refused \(3 attempts\)") as err:
        asyncio.run(wf.call("reset", {"task": {}}))
    assert err.value.hint == "is the environment server running?"


def test_a_server_started_late_is_reached_by_retries(tokenizer: Any, tmp_path: Path) -> None:
    """Refused connections are resent: a reset sent before the server listens succeeds once it does."""
    port = free_port()
    wf = EnvServerWorkflow(EnvServerConfig(url=f"http://127.0.0.1:{port}", retries=50, retry_backoff_s=0.05))
    first_refused = threading.Event()
    real = wf._post_once

    def spy(name: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return real(name, url, body)
        except Exception:
            first_refused.set()
            raise

    wf._post_once = spy  # type: ignore[method-assign]
    servers = []

    def serve_after_refusal() -> None:
        first_refused.wait(30)
        servers.append(make_server(port))  # binds and listens only now
        servers[0].serve_forever()

    threading.Thread(target=serve_after_refusal, daemon=True).start()
    try:
        out = asyncio.run(wf.call("reset", {"task": {"index": 1}}))
        assert first_refused.is_set() and out["observation"] == "Say the word river."
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_the_last_step_needs_no_observation(tokenizer: Any) -> None:
    # `done: true` without an observation ends the episode (the policy sees nothing more); a step that
    # goes on without one is still refused with what is missing
    srv, url = _fault_server(
        {
            "reset": lambda n: {"session": "s", "observation": "Say the word apple."},
            "step": lambda n: {"done": True},
            "reward": lambda n: {"reward": 1.0},
        }
    )
    try:
        wf = EnvServerWorkflow(EnvServerConfig(url=url, max_turns=3))
        ep = asyncio.run(
            wf.run_episode({"index": 0}, {"actor": ScriptedPolicy(tokenizer, lambda p: "apple")})
        )
        assert ep.sequences[0].reward == 1.0 and ep.info["done"] == 1.0 and ep.info["turns"] == 1.0
        srv.answers["step"] = lambda n: {"done": False}
        with pytest.raises(EnvServerError, match="observation"):
            asyncio.run(wf.run_episode({"index": 0}, {"actor": ScriptedPolicy(tokenizer, lambda p: "apple")}))
    finally:
        srv.shutdown()

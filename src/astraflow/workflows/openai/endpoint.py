"""One episode's OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Agent code calls it like any OpenAI server; every completion is sampled by the policy's engine and
recorded exactly as generated (token ids, behaviour logprobs, weight versions). Requests are grouped
into trajectories, one Sequence each:

- chat: a request whose messages start with a recorded trajectory's messages (the assistant turns
  exactly as this endpoint returned them) extends it: the prompt is the trajectory's recorded ids
  (the engine's ids for earlier assistant turns, never re-tokenized) followed by the chat template's
  rendering of the new messages. Otherwise (first request, edited history, a template that rewrites
  earlier turns, different sampling settings) a new trajectory starts from the rendered conversation.
- completions: a prompt that starts with a trajectory's prompt + returned text (or, given as token
  ids, with its recorded ids) extends it; else a new trajectory.

Either way the engine is prompted with exactly the ids that are recorded, so what the trainer scores
is what the engine saw and produced. A trajectory extended later is superseded by its extension; the
episode's Sequences are the trajectories nobody extended (n > 1 branches each become one).
Streaming (stream.py) and tool calls (tool_calls.py) go through the same path.

Over 400 lines because it is one class, the endpoint of one episode, whose request handlers share
the episode's recorded trajectories; streaming, tools and the HTTP server are in their own modules.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from astraflow.engines.base import Completion
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import MIN_TEMPERATURE, Sequence
from astraflow.workflows.base import PolicyClient
from astraflow.workflows.common.loopback_http import EventStream, HttpError
from astraflow.workflows.openai.stream import Answer, chat_chunks, completion_chunks
from astraflow.workflows.openai.tool_calls import (
    api_message,
    check_template,
    check_tools,
    forced_ids,
    forced_prefix,
    parse_tool_calls,
    template_message,
)
from astraflow.workflows.transcript import Transcript, TranscriptError

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "logprobs", "user", "seed"}
_COMMON |= {"frequency_penalty", "presence_penalty", "stream_options", "metadata", "store", "logit_bias"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
CHAT_PARAMS |= {"response_format", "parallel_tool_calls"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_N = 64
MAX_STOPS = 4
MAX_MESSAGES = 1024
"""Most messages one chat request may carry (checked before any is rendered)."""


@dataclass
class Trajectory:
    """One recorded conversation of one role."""

    role: str
    transcript: Transcript
    text: str = ""
    """Completions mode: the prompt text plus the returned completions, for prefix matching."""
    parent: Trajectory | None = None
    """The recorded trajectory this one extends (None: it started fresh)."""
    superseded: bool = False
    """A later request extended it: its extension carries all of it."""
    api: list[dict[str, Any]] | None = None
    """Chat mode: the conversation as the agent sees it (requests' messages, returned messages), in
    api_message form, for prefix matching; the transcript keeps the template's form."""


def _refuse(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HttpError(400, f"unsupported parameter(s) {unknown}; supported: {sorted(allowed)}")
    if body.get("stream_options") is not None:
        opts = body["stream_options"]
        if not body.get("stream") or not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise HttpError(400, "stream_options takes only include_usage, and only with stream=true")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**62):
        raise HttpError(400, "seed must be an integer in [0, 2**62)")
    if body.get("store"):
        raise HttpError(400, "store=true is not supported: this endpoint stores nothing for later retrieval")
    if body.get("logit_bias"):
        raise HttpError(400, "logit_bias is not supported (it would change the sampling distribution)")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise HttpError(400, "metadata must be an object")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise HttpError(400, f"{key} is not supported (it would change the sampling distribution)")


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise HttpError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return stops


def cut_at_stop(tokenizer: Any, c: Completion, stops: list[str]) -> tuple[Completion, str | None]:
    """The completion cut after the first token whose text completes a stop string, and the text
    before that string (None: no stop string). The kept tokens are a prefix of what the engine sampled,
    so their logprobs and versions stay exact."""
    ids = list(c.token_ids)

    def hit(k: int) -> int:
        text = str(tokenizer.decode(ids[:k], skip_special_tokens=True))
        found = [text.find(s) for s in stops if s in text]
        return min(found) if found else -1

    if not stops or hit(len(ids)) < 0:
        return c, None
    lo, hi = 1, len(ids)  # smallest k whose prefix text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) >= 0 else (mid + 1, hi)
    text = str(tokenizer.decode(ids[:lo], skip_special_tokens=True))
    cut = Completion(ids[:lo], list(c.logprobs[:lo]), list(c.versions[:lo]), "stop", c.sampling)
    return cut, text[: hit(lo)]


class EpisodeEndpoint:
    """Serves one episode's requests against its policies and records the trajectories.

    Public for workflows built on it (`openai_agent.serve_episode`): `trajectories` lists every
    recorded Trajectory in request order (`role`: the role the request's model named; `transcript`:
    its tokens, masks and turns; `superseded`: a later request extended it), `kept()` those that become
    Sequences, `sequences(reward, rewards)` the Sequences with per-role rewards, `requests` the number
    of requests served and `turns()` the policy turns of the kept trajectories."""

    def __init__(self, policies: dict[str, PolicyClient], *, max_tokens: int) -> None:
        """`policies`: role -> client (the model name is the role or its policy); `max_tokens`: context
        budget of one trajectory."""
        self.policies = policies
        self.max_tokens = max_tokens
        self.trajectories: list[Trajectory] = []
        self.requests = 0

    async def handle(self, method: str, path: str, body: Any) -> Any:
        """Route one HTTP request."""
        path = path.rstrip("/")
        if path == "/v1/models" and method == "GET":
            return {"object": "list", "data": [self._model(r) for r in self.policies]}
        if path not in ("/v1/chat/completions", "/v1/completions"):
            raise HttpError(404, f"no route {method} {path}")
        if method != "POST":
            raise HttpError(405, f"{path} takes POST")
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        self.requests += 1
        if path == "/v1/chat/completions":
            return await self.chat(body)
        return await self.complete(body)

    @staticmethod
    def _model(role: str) -> dict[str, Any]:
        return {"id": role, "object": "model", "created": 0, "owned_by": "astraflow"}

    def _policy(self, model: Any) -> tuple[str, PolicyClient]:
        if model in self.policies:
            return str(model), self.policies[model]
        by_policy = [(r, c) for r, c in self.policies.items() if c.policy == model]
        if by_policy:
            return by_policy[0]
        if len(self.policies) == 1:  # one role: any model name means it (agent code hard-codes names)
            return next(iter(self.policies.items()))
        raise HttpError(404, f"unknown model {model!r}; this endpoint serves {sorted(self.policies)}")

    @staticmethod
    def _sampling(body: dict[str, Any]) -> dict[str, float]:
        ov: dict[str, float] = {}
        t, p = body.get("temperature"), body.get("top_p")
        if t is not None:
            if not isinstance(t, int | float) or not t >= MIN_TEMPERATURE:
                raise HttpError(
                    400,
                    f"temperature must be >= {MIN_TEMPERATURE} (greedy decoding has no behaviour logprobs)",
                )
            ov["temperature"] = float(t)
        if p is not None:
            if not isinstance(p, int | float) or not 0 < p <= 1:
                raise HttpError(400, "top_p must be in (0, 1]")
            ov["top_p"] = float(p)
        return ov

    @staticmethod
    def _seed(body: dict[str, Any]) -> dict[str, int]:
        # the engine's per-request seed (GenerationRequest.seed; choice i of n uses seed + i); not a
        # sampling setting of the Sequence, so it is passed to generate() only, never recorded
        return {} if body.get("seed") is None else {"seed": int(body["seed"])}

    @staticmethod
    def _n(body: dict[str, Any]) -> int:
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise HttpError(400, f"n must be an integer in [1, {MAX_N}]")
        return n

    def _max_new(self, body: dict[str, Any], tr: Transcript, client: PolicyClient) -> int:
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise HttpError(400, "max_tokens must be a positive integer")
        default = int(getattr(getattr(client, "sampling", None), "max_new_tokens", 256))
        room = tr.room() or 0
        if room <= 0:
            raise HttpError(
                400,
                f"the conversation ({len(tr.tokens)} tokens) fills the context budget "
                f"max_tokens={self.max_tokens}",
                "context_length_exceeded",
            )
        return min(int(asked or default), room)

    def _extend(self, base: Trajectory | None, fresh: Trajectory, grow: Any) -> Trajectory:
        """`base` forked and grown by `grow(transcript)`, or `fresh` when that is impossible."""
        if base is not None:
            api = None if base.api is None else list(base.api)
            fork = Trajectory(base.role, base.transcript.fork(), base.text, parent=base, api=api)
            try:
                grow(fork)
                return fork
            except TranscriptError:
                pass
        return fresh

    # ----- chat --------------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any]) -> dict[str, Any] | EventStream:
        """POST /v1/chat/completions."""
        _refuse(body, CHAT_PARAMS)
        if body.get("top_logprobs"):
            raise HttpError(400, "top_logprobs is not supported (only the sampled token's logprob)")
        fmt = body.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise HttpError(400, "response_format other than text is not supported")
        tools, parse = check_tools(body)
        role, client = self._policy(body.get("model"))
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise HttpError(400, "messages must be a non-empty list")
        if len(raw) > MAX_MESSAGES:
            raise HttpError(400, f"at most {MAX_MESSAGES} messages per request, not {len(raw)}")
        messages = [api_message(m) for m in raw]
        if tools or any("tool_calls" in m for m in messages):
            check_template(client.tokenizer, [template_message(m) for m in messages], tools)
        ov, n, stops = self._sampling(body), self._n(body), _stops(body)
        base = self._chat_base(role, client, messages, tools, ov)
        prompt = base.transcript.prompt_ids()
        prefix = forced_prefix(body, tools) if parse else ""
        forced = forced_ids(client.tokenizer, prefix) if prefix else []
        max_new = self._max_new(body, base.transcript, client) - len(forced)
        if max_new < 1:
            raise HttpError(400, "no room left for a tool call under the context budget")
        outs = await client.generate(prompt + forced, n=n, max_new_tokens=max_new, **ov, **self._seed(body))
        answers: list[Answer] = []
        for out in outs:
            c, cut_text = cut_at_stop(client.tokenizer, out, stops)
            tr = Trajectory(role, base.transcript.fork(), parent=base.parent, api=list(base.api or []))
            if forced:
                tr.transcript.force(forced)
            tr.transcript.add_completion(c, max_new_tokens=max_new, **ov)
            if cut_text is not None:  # the agent sends back what it got; match on that
                tr.transcript.messages[-1]["content"] = str(client.tokenizer.decode(forced)) + cut_text
            if forced:  # the answer as the agent sees it starts with the forced text (logprob 0: certain)
                c = Completion(
                    forced + list(c.token_ids),
                    [0.0] * len(forced) + list(c.logprobs),
                    [-1] * len(forced) + list(c.versions),
                    c.finish_reason,
                    c.sampling,
                )
            text = str(tr.transcript.messages[-1]["content"])
            content, calls = parse_tool_calls(text) if parse and c.finish_reason == "stop" else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            assert tr.api is not None
            tr.api.append(api_message(message))
            self._record(base, tr)
            answers.append(Answer(c, text, message, "tool_calls" if calls else c.finish_reason))
        used = sum(len(a.completion.token_ids) for a in answers)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": used, "total_tokens": len(prompt) + used}
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": role}
        lp_fn = (lambda c: self._token_logprobs(client, c)) if body.get("logprobs") else None
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventStream(
                chat_chunks(head, answers, client.tokenizer, lp_fn, usage if include else None)
            )
        choices = [
            {
                "index": i,
                "message": a.message,
                "finish_reason": a.finish_reason,
                "logprobs": None if lp_fn is None else {"content": lp_fn(a.completion)},
            }
            for i, a in enumerate(answers)
        ]
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage}

    def _chat_base(
        self,
        role: str,
        client: PolicyClient,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        ov: dict[str, float],
    ) -> Trajectory:
        best: Trajectory | None = None
        for t in self.trajectories:
            known = t.api or []
            if (
                t.role == role
                and t.transcript.chat
                and t.transcript.tools == tools
                and messages[: len(known)] == known
                and (best is None or len(known) > len(best.api or []))
            ):
                best = t

        def grow(fork: Trajectory) -> None:
            new = messages[len(fork.api or []) :]
            if new:  # all at once: templates may group consecutive tool results
                fork.transcript.add_messages([template_message(m) for m in new])
            fork.api = list(messages)
            fork.transcript.prompt_ids()
            # one Sequence has one SamplingParams: a request with other settings starts a new one
            if not fork.transcript.accepts(client.sampling_params(**ov)):
                raise TranscriptError("the request's sampling settings differ from the conversation's")

        fresh = Trajectory(
            role, Transcript(client, chat=True, max_tokens=self.max_tokens), api=list(messages)
        )
        fresh.transcript.tools = tools
        chosen = self._extend(best, fresh, grow)
        if chosen is fresh:
            fresh.transcript.start_conversation([template_message(m) for m in messages])
        return chosen

    def _record(self, base: Trajectory, tr: Trajectory) -> None:
        if base.parent is not None:  # its extension carries all of it
            base.parent.superseded = True
        self.trajectories.append(tr)

    @staticmethod
    def _token_logprobs(client: PolicyClient, c: Completion) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(c.token_ids, c.logprobs, strict=True):
            tok = str(client.tokenizer.decode([tid]))
            out.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode()), "top_logprobs": []})
        return out

    # ----- completions -------------------------------------------------------------------------

    async def complete(self, body: dict[str, Any]) -> dict[str, Any] | EventStream:
        """POST /v1/completions."""
        _refuse(body, COMPLETION_PARAMS)
        if body.get("echo"):
            raise HttpError(400, "echo is not supported")
        if body.get("suffix"):
            raise HttpError(400, "suffix is not supported")
        if body.get("best_of") not in (None, 1, body.get("n")):
            raise HttpError(400, "best_of is not supported")
        if body.get("logprobs") not in (None, 0, False):
            if body.get("logprobs") not in (1, True):
                raise HttpError(400, "logprobs > 1 is not supported (only the sampled token's logprob)")
        role, client = self._policy(body.get("model"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        is_ids = isinstance(prompt, list) and all(isinstance(x, int) for x in prompt)
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise HttpError(400, "prompt must be one non-empty string or one list of token ids")
        ov, n, stops = self._sampling(body), self._n(body), _stops(body)
        base = self._raw_base(role, client, prompt, ov)
        ids = base.transcript.prompt_ids()
        max_new = self._max_new(body, base.transcript, client)
        outs = await client.generate(ids, n=n, max_new_tokens=max_new, **ov, **self._seed(body))
        answers: list[Answer] = []
        for out in outs:
            c, cut_text = cut_at_stop(client.tokenizer, out, stops)
            tr = Trajectory(role, base.transcript.fork(), base.text, parent=base.parent)
            turn = tr.transcript.add_completion(c, max_new_tokens=max_new, **ov)
            text = turn.text if cut_text is None else cut_text
            tr.text = base.text + text
            self._record(base, tr)
            answers.append(Answer(c, text, None, c.finish_reason))
        used = sum(len(a.completion.token_ids) for a in answers)
        usage = {"prompt_tokens": len(ids), "completion_tokens": used, "total_tokens": len(ids) + used}
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": role}
        want_lp = body.get("logprobs") not in (None, 0, False)
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventStream(
                completion_chunks(head, answers, client.tokenizer, want_lp, usage if include else None)
            )
        choices = []
        for i, a in enumerate(answers):
            c = a.completion
            lp = None
            if want_lp:
                lp = {
                    "tokens": [str(client.tokenizer.decode([t])) for t in c.token_ids],
                    "token_logprobs": [float(x) for x in c.logprobs],
                    "top_logprobs": None,
                    "text_offset": None,
                }
            choices.append({"index": i, "text": a.text, "finish_reason": a.finish_reason, "logprobs": lp})
        return {**head, "object": "text_completion", "choices": choices, "usage": usage}

    def _raw_base(
        self, role: str, client: PolicyClient, prompt: str | list[int], ov: dict[str, float]
    ) -> Trajectory:
        best: Trajectory | None = None
        for t in self.trajectories:
            if t.role != role or t.transcript.chat or not t.transcript.turns:
                continue
            known: Any = t.text if isinstance(prompt, str) else t.transcript.tokens
            if prompt[: len(known)] == known and (best is None or len(known) > len(best.transcript.tokens)):
                best = t

        def grow(fork: Trajectory) -> None:
            if isinstance(prompt, str):
                fork.transcript.add_text(prompt[len(fork.text) :])
                fork.text = prompt
            else:
                fork.transcript.add_ids(list(prompt[len(fork.transcript.tokens) :]))
            if not fork.transcript.accepts(client.sampling_params(**ov)):
                raise TranscriptError("the request's sampling settings differ from the conversation's")

        fresh = Trajectory(role, Transcript(client, chat=False, max_tokens=self.max_tokens))
        chosen = self._extend(best, fresh, grow)
        if chosen is fresh:
            if isinstance(prompt, str):
                fresh.transcript.add_text(prompt, special_tokens=True)
                fresh.text = prompt
            else:
                fresh.transcript.add_ids(list(prompt))
                fresh.text = str(client.tokenizer.decode(list(prompt)))
        return chosen

    # ----- the result --------------------------------------------------------------------------

    def kept(self) -> list[Trajectory]:
        """The trajectories that become Sequences: those with a policy turn that nobody extended."""
        return [t for t in self.trajectories if t.transcript.turns and not t.superseded]

    def sequences(self, reward: float | None, rewards: Mapping[str, float] | None = None) -> list[Sequence]:
        """One Sequence per kept trajectory, tagged with its role: `rewards[role]` where given, else
        `reward` (None: every kept trajectory's role must be in `rewards`)."""
        rewards = rewards or {}
        out = []
        for t in self.kept():
            r = rewards.get(t.role, reward)
            if r is None:
                raise AstraflowError(
                    f"no reward for role {t.role!r}: the rewards name {sorted(rewards)}",
                    hint="give a reward for every role the agent used, or a 'reward' for the others",
                )
            out.append(msgspec.structs.replace(t.transcript.sequence(float(r)), role=t.role))
        return out

    def turns(self) -> int:
        """Policy turns across the kept trajectories."""
        return sum(len(t.transcript.turns) for t in self.trajectories if not t.superseded)

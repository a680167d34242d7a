"""The `env_server` workflow: an external environment behind a small HTTP/JSON protocol, no code needed.

Protocol (every call is a POST of a JSON object to `<url>/<name>`, answered with a JSON object):

  reset   {"task": {...the dataset row...}}
          -> {"session": str, "observation": str, "system"?: str, "tools"?: [OpenAI function tools]}
  step    {"session": str, "action": str, "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": str}}]}
          -> {"observation"?: str, "tool_results"?: [{"tool_call_id": str, "content": str}], "done": bool}
          ("observation" may be left out beside tool results, and on the step that says done)
  reward  {"session": str}                         -> {"reward": float, "info"?: {name: number}}

The workflow plays one episode per session: the observation is the user's message (chat) or appended
text (raw), the policy's turn is the action, until `done`, `max_turns` or the context budget; then
`reward` scores the episode and ends the session. With `tools`, the chat template renders them, the
policy's tool calls (parsed from its turn) go with the action, and the tool results come back as
`tool` messages (with their `tool_call_id`). A non-2xx answer or malformed JSON fails the episode
with the server's message. astraflow.workflows.env_protocol.reference is a small reference server.

Retries: a call whose request never fully reached the server (connection refused or reset while
connecting or sending) is retried, as is `reward` (idempotent by the protocol: a server answers the
same for a session it already scored) whatever failed; `reset` and `step` are never resent once sent.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.common.loopback_http import in_daemon_thread
from astraflow.workflows.openai.tool_calls import parse_tool_calls
from astraflow.workflows.transcript import Transcript, TranscriptFull


class EnvServerConfig(BaseModel):
    """Options of the env_server workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str
    """Base URL of the environment server, e.g. http://127.0.0.1:8700."""
    chat: bool = True
    """Observations as user messages through the chat template (False: raw text appended)."""
    max_turns: int = Field(4, ge=1)
    """Policy turns per episode."""
    max_tokens: int = Field(2048, ge=16)
    """Context budget of the whole conversation."""
    request_timeout_s: float = Field(30.0, gt=0)
    """One reset / step / reward call taking longer fails the episode."""
    num_tasks: int = Field(1024, ge=1)
    """Tasks {"index": i} generated when the recipe names no dataset file (the server picks the game)."""
    retries: int = Field(3, ge=0)
    """Extra attempts of a call that is safe to resend (see the protocol's retry rule)."""
    retry_backoff_s: float = Field(0.2, ge=0)
    """Wait before the first retry; doubled before each next one (at most 2 s)."""


MAX_BACKOFF_S = 2.0
"""Longest wait between two attempts."""
IDEMPOTENT = frozenset({"reward"})
"""Calls the protocol makes safe to resend after the server may have seen them."""


class EnvServerError(AstraflowError):
    """The environment server refused a call or answered outside the protocol."""


class EnvServerWorkflow(Workflow):
    """One episode per environment session; the policy's turns are its actions."""

    Config = EnvServerConfig
    roles = ("actor",)

    def __init__(self, config: EnvServerConfig) -> None:
        super().__init__(config)
        self.config: EnvServerConfig = config

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """Task indices; a server that needs richer tasks reads them from the recipe's dataset file."""
        for i in range(size or self.config.num_tasks):
            yield {"index": i, "seed": seed}

    def _post(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """One protocol call with the safe retries; a clear EnvServerError when it fails."""
        cfg = self.config
        url = f"{cfg.url.rstrip('/')}/{name}"
        attempts = cfg.retries + 1
        failure: _Unsent | _Lost | None = None
        for attempt in range(1, attempts + 1):
            try:
                return self._post_once(name, url, body)
            except _Unsent as exc:  # the server never got the whole request: always safe to resend
                failure = exc
            except _Lost as exc:
                if name not in IDEMPOTENT:
                    raise EnvServerError(
                        f"env server {name} at {url}: {exc.reason} after the request was sent; "
                        f"not resent ({name} may have been carried out)",
                        hint="an overloaded server? see its logs; request_timeout_s bounds one call",
                    ) from None
                failure = exc
            if attempt < attempts:
                time.sleep(min(cfg.retry_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        assert failure is not None
        refused = isinstance(failure, _Unsent) and failure.refused
        raise EnvServerError(
            f"env server {name} at {url}: {failure.reason} ({attempts} attempt{'s' * (attempts > 1)})",
            hint="is the environment server running?" if refused else "",
        ) from None

    def _post_once(self, name: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        timeout = self.config.request_timeout_s
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise EnvServerError(f"env server {name}: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:  # raised while connecting or sending the request
            reason = exc.reason
            if isinstance(reason, ConnectionRefusedError):
                raise _Unsent("connection refused", refused=True) from None
            if isinstance(reason, TimeoutError):
                raise _Unsent(f"could not connect within request_timeout_s={timeout}") from None
            raise _Unsent(f"connection failed while sending ({reason})") from None
        except TimeoutError:
            raise _Lost(f"no answer within request_timeout_s={timeout}") from None
        except (http.client.HTTPException, OSError) as exc:  # while waiting for or reading the answer
            raise _Lost(f"connection lost ({type(exc).__name__}: {exc})") from None
        try:
            out = json.loads(raw)
        except ValueError:
            raise EnvServerError(f"env server {name}: the answer is not JSON") from None
        if not isinstance(out, dict):
            raise EnvServerError(f"env server {name}: the answer is not a JSON object")
        return out

    async def call(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """One protocol call, in a thread (never blocks the event loop)."""
        out: dict[str, Any] = await in_daemon_thread(self._post, name, body)
        return out

    @staticmethod
    def _text(out: dict[str, Any], key: str, name: str) -> str:
        value = out.get(key)
        if not isinstance(value, str):
            raise EnvServerError(f"env server {name}: {key!r} must be a string, got {value!r}")
        return value

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """reset, then (generate, step) until done, then reward."""
        cfg = self.config
        start = await self.call("reset", {"task": sample})
        session = self._text(start, "session", "reset")
        tr = Transcript(policies["actor"], chat=cfg.chat, max_tokens=cfg.max_tokens)
        tools = _tools(start.get("tools"))
        if tools and not cfg.chat:
            raise EnvServerError(
                "env server reset: 'tools' need chat = true (the chat template renders them)"
            )
        tr.tools = tools
        observation: str | None = self._text(start, "observation", "reset")
        results: list[dict[str, Any]] = []
        if cfg.chat and isinstance(start.get("system"), str):
            tr.add_message("system", start["system"])
        done, steps, n_calls = False, 0, 0
        try:
            while not done and steps < cfg.max_turns:
                _feed(tr, cfg.chat, observation, results)
                turn = await tr.generate()
                steps += 1
                action: dict[str, Any] = {"session": session, "action": turn.text}
                calls: list[dict[str, Any]] = []
                if tools and not turn.truncated:
                    _, calls = parse_tool_calls(turn.text)
                    if calls:
                        action["tool_calls"] = calls
                        n_calls += len(calls)
                out = await self.call("step", action)
                results = _tool_results(out.get("tool_results"), calls)
                observation, done = _step_outcome(out, bool(results))
        except TranscriptFull:
            pass  # out of context: the episode ends here and is scored as it stands
        end = await self.call("reward", {"session": session})
        reward = _reward(end)
        if not tr.turns:
            raise EnvServerError("the episode ended before the policy's first turn")
        info: dict[str, Scalar] = {"turns": float(steps), "done": float(done)}
        if tools:
            info["tool_calls"] = float(n_calls)
        extra = end.get("info") or {}
        if isinstance(extra, dict):
            info.update({f"env_{k}"[:255]: float(v) for k, v in extra.items() if isinstance(v, int | float)})
        return Episode(sequences=[tr.sequence(reward)], info=info)


class _Unsent(Exception):
    """The request never fully reached the server (safe to resend)."""

    def __init__(self, reason: str, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


class _Lost(Exception):
    """The request was sent but no answer came back (the server may have carried it out)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _feed(tr: Transcript, chat: bool, observation: str | None, results: list[dict[str, Any]]) -> None:
    """Give the policy the last step's tool results and observation (an empty observation beside tool
    results adds no user message; without tools every observation is one)."""
    pending = list(results)
    if observation is not None and (observation or not results):
        pending.append({"role": "user", "content": observation})
    if chat:
        if pending:
            tr.add_messages(pending)
    else:
        tr.add_text(observation or "")


def _step_outcome(out: dict[str, Any], has_results: bool) -> tuple[str | None, bool]:
    """step's (observation, done), checked; the observation may be absent beside tool results, or on
    the last step (done: the policy sees nothing more)."""
    done = out.get("done")
    if not isinstance(done, bool):
        raise EnvServerError(f"env server step: 'done' must be a boolean, got {done!r}")
    if has_results or done:
        observation = out.get("observation")
    else:
        observation = EnvServerWorkflow._text(out, "observation", "step")
    if observation is not None and not isinstance(observation, str):
        raise EnvServerError(f"env server step: 'observation' must be a string, got {observation!r}")
    return observation, done


def _reward(end: dict[str, Any]) -> float:
    """reward's 'reward', checked to be a finite number."""
    reward = end.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvServerError(f"env server reward: 'reward' must be a finite number, got {reward!r}")
    return float(reward)


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """reset's `tools`: a list of OpenAI function tools, or None."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in value
    ):
        raise EnvServerError(
            "env server reset: 'tools' must be a list of {type: 'function', function: {name, ...}}"
        )
    return value


def _tool_results(value: Any, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """step's `tool_results` as tool messages; each must answer one of this turn's tool calls."""
    if value is None or value == []:
        return []
    ids = {c["id"]: c["function"]["name"] for c in calls}
    if not isinstance(value, list):
        raise EnvServerError("env server step: 'tool_results' must be a list")
    out = []
    for r in value:
        if not (
            isinstance(r, dict)
            and isinstance(r.get("tool_call_id"), str)
            and isinstance(r.get("content"), str)
        ):
            raise EnvServerError(
                "env server step: each tool_results entry needs 'tool_call_id' and 'content' strings"
            )
        if r["tool_call_id"] not in ids:
            raise EnvServerError(
                f"env server step: tool result for {r['tool_call_id']!r}, which is no tool call of this turn"
            )
        out.append(
            {
                "role": "tool",
                "tool_call_id": r["tool_call_id"],
                "name": ids[r["tool_call_id"]],
                "content": r["content"],
            }
        )
    return out

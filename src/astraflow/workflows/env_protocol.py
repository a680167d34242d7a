"""The `env_server` workflow: an external environment behind a small HTTP/JSON protocol, no code needed.

Protocol (every call is a POST of a JSON object to `<url>/<name>`, answered with a JSON object):

  reset   {"task": {...the dataset row...}}        -> {"session": str, "observation": str, "system"?: str}
  step    {"session": str, "action": str}          -> {"observation": str, "done": bool}
  reward  {"session": str}                         -> {"reward": float, "info"?: {name: number}}

The workflow plays one episode per session: the observation is the user's message (chat) or appended
text (raw), the policy's turn is the action, until `done`, `max_turns` or the context budget; then
`reward` scores the episode and ends the session. A non-2xx answer or malformed JSON fails the episode
with the server's message. astraflow.workflows.env_reference is a small reference server.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.loopback_http import in_daemon_thread
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
        url = f"{self.config.url.rstrip('/')}/{name}"
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.config.request_timeout_s) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise EnvServerError(f"env server {name}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise EnvServerError(
                f"env server {name} at {url}: {exc}", hint="is the environment server running?"
            ) from None
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
        observation = self._text(start, "observation", "reset")
        if cfg.chat and isinstance(start.get("system"), str):
            tr.add_message("system", start["system"])
        done, steps = False, 0
        try:
            while not done and steps < cfg.max_turns:
                if cfg.chat:
                    tr.add_message("user", observation)
                else:
                    tr.add_text(observation)
                turn = await tr.generate()
                steps += 1
                out = await self.call("step", {"session": session, "action": turn.text})
                observation = self._text(out, "observation", "step")
                flag = out.get("done")
                if not isinstance(flag, bool):
                    raise EnvServerError(f"env server step: 'done' must be a boolean, got {flag!r}")
                done = flag
        except TranscriptFull:
            pass  # out of context: the episode ends here and is scored as it stands
        end = await self.call("reward", {"session": session})
        reward = end.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise EnvServerError(f"env server reward: 'reward' must be a finite number, got {reward!r}")
        if not tr.turns:
            raise EnvServerError("the episode ended before the policy's first turn")
        info: dict[str, Scalar] = {"turns": float(steps), "done": float(done)}
        extra = end.get("info") or {}
        if isinstance(extra, dict):
            info.update({f"env_{k}"[:255]: float(v) for k, v in extra.items() if isinstance(v, int | float)})
        return Episode(sequences=[tr.sequence(float(reward))], info=info)

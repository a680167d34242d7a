"""The `openai_agent` workflow: run a user's agent, written against any OpenAI-compatible client,
against the policy, and train on exactly what the engine generated for it.

Each episode gets its own endpoint on loopback (`AgentEndpoint`: base_url + a per-episode api key);
the recipe names the agent callable, `agent(endpoint, task) -> reward | answer`, and optionally a
`reward(task, answer) -> float` to score what it returns. A plain (sync) agent runs in a thread pool
(a daemon thread of its own) so it may block on HTTP; an `async def` agent is awaited on the event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.loopback_http import LoopbackServer, in_daemon_thread
from astraflow.workflows.openai_endpoint import EpisodeEndpoint

CALLABLE = re.compile(r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """Import `pkg.module:name` or `path/to/file.py:name` (a relative path is from the working dir)."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            mod_spec = importlib.util.spec_from_file_location(f"astraflow_user_{path.stem}", path)
            if mod_spec is None or mod_spec.loader is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except Exception as exc:
        raise AstraflowError(
            f"cannot load the {what} {spec!r}: {type(exc).__name__}: {exc}",
            hint="name it as package.module:function or path/to/file.py:function",
        ) from exc
    if not callable(fn):
        raise AstraflowError(f"the {what} {spec!r} is not callable")
    return fn


@dataclass(frozen=True)
class AgentEndpoint:
    """What an agent gets: an OpenAI-compatible endpoint serving the policy for this episode only."""

    base_url: str
    """e.g. http://127.0.0.1:PORT/<token>/v1 -- pass as base_url to an OpenAI client."""
    api_key: str
    """The episode's key; requests without it are refused."""
    model: str
    """The model name to ask for (the workflow's role; any name works when it has one role)."""

    def openai(self, **kwargs: Any) -> Any:
        """An `openai.OpenAI` client for this endpoint (needs the openai package)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client for this endpoint."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kwargs)


async def serve_episode(
    server: LoopbackServer,
    policies: dict[str, PolicyClient],
    max_tokens: int,
    timeout_s: float,
    run: Callable[[AgentEndpoint], Awaitable[Any]],
) -> tuple[EpisodeEndpoint, Any]:
    """Open an endpoint for one episode, await `run(endpoint)`, close it; the records and the result."""
    await server.start()
    ep = EpisodeEndpoint(policies, max_tokens=max_tokens)
    token = server.register(ep.handle)
    endpoint = AgentEndpoint(f"{server.url(token)}/v1", token, next(iter(policies)))
    try:
        result = await asyncio.wait_for(run(endpoint), timeout_s)
    except TimeoutError:
        raise AstraflowError(f"the agent ran past its episode timeout ({timeout_s} s)") from None
    finally:
        server.revoke(token)  # a straggling thread of this agent gets 401 from now on
    return ep, result


class OpenAIAgentConfig(BaseModel):
    """Options of the openai_agent workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    agent: str
    """The agent: `package.module:function` or `path/to/file.py:function`, called as
    agent(endpoint: AgentEndpoint, task: dict); it returns the reward, or an answer for `reward`."""
    reward: str = ""
    """`reward(task, answer) -> float` scoring what the agent returned ("" = the agent returns the reward
    as a number, or a dict with a "reward" key)."""
    tasks: str = ""
    """`tasks(seed, size) -> iterable of dicts` when the recipe names no dataset file."""
    max_tokens: int = Field(4096, ge=16)
    """Context budget of one trajectory (prompt + all turns); a request past it gets a 400."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """An agent still running after this long fails the episode (its endpoint is closed)."""

    @field_validator("agent", "reward", "tasks")
    @classmethod
    def _callable(cls, v: str) -> str:
        if v and not CALLABLE.match(v):
            raise ValueError(f"{v!r} is not package.module:function or path/to/file.py:function")
        return v


class OpenAIAgentWorkflow(Workflow):
    """Bring-your-own-agent: an OpenAI-compatible endpoint per episode, trajectories recorded exactly."""

    Config = OpenAIAgentConfig
    roles = ("actor",)

    def __init__(self, config: OpenAIAgentConfig) -> None:
        super().__init__(config)
        self.config: OpenAIAgentConfig = config
        self.server = LoopbackServer()
        self._fns: dict[str, Callable[..., Any]] = {}

    def _fn(self, key: str) -> Callable[..., Any]:
        if key not in self._fns:
            self._fns[key] = load_callable(getattr(self.config, key), key)
        return self._fns[key]

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """Tasks from the `tasks` callable (the recipe's dataset file is used when given)."""
        if not self.config.tasks:
            raise AstraflowError(
                "the openai_agent workflow has no tasks", hint="set dataset.path or workflow.options.tasks"
            )
        for i, row in enumerate(self._fn("tasks")(seed, size)):
            if size and i >= size:
                return
            yield dict(row)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await in_daemon_thread(fn, *args)

    async def run_agent(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], agent: Callable[..., Any]
    ) -> tuple[EpisodeEndpoint, Any]:
        """Serve one episode's endpoint while `agent(endpoint, sample)` runs; its result and records."""
        cfg = self.config
        return await serve_episode(
            self.server,
            policies,
            cfg.max_tokens,
            cfg.episode_timeout_s,
            lambda e: self._call(agent, e, sample),
        )

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Run the agent on one task; every trajectory it generated gets the episode's reward."""
        ep, answer = await self.run_agent(sample, policies, self._fn("agent"))
        if self.config.reward:
            reward = await self._call(self._fn("reward"), sample, answer)
        elif isinstance(answer, dict) and "reward" in answer:
            reward = answer["reward"]
        else:
            reward = answer
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise AstraflowError(
                f"the agent's reward is {type(reward).__name__}, not a number",
                hint="return a float from the agent, or set workflow.options.reward to score its answer",
            )
        sequences = ep.sequences(float(reward))
        if not sequences:
            raise AstraflowError("the agent made no completion request to its endpoint")
        info: dict[str, Scalar] = {
            "requests": float(ep.requests),
            "trajectories": float(len(sequences)),
            "turns": float(ep.turns()),
        }
        return Episode(sequences=sequences, info=info)

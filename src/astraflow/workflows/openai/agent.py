"""The `openai_agent` workflow: run a user's agent, written against any OpenAI-compatible client,
against the policy, and train on exactly what the engine generated for it.

Each episode gets its own endpoint on loopback (`AgentEndpoint`: base_url + a per-episode api key);
the recipe names the agent callable, `agent(endpoint, task) -> reward | answer`, and optionally a
`reward(task, answer)` to score what it returns. A reward is a number or a dict with per-role rewards
and episode info (`agent_result`). A plain (sync) agent runs in a thread pool
(a daemon thread of its own) so it may block on HTTP; an `async def` agent is awaited on the event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.common.loopback_http import LoopbackServer, in_daemon_thread
from astraflow.workflows.openai.endpoint import EpisodeEndpoint

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
    any_roles = True
    """workflow.roles may name any roles: the agent asks for each by its name as the `model`."""

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
        """Run the agent on one task; its trajectories get the rewards of `agent_result`."""
        ep, answer = await self.run_agent(sample, policies, self._fn("agent"))
        value = await self._call(self._fn("reward"), sample, answer) if self.config.reward else answer
        what = "reward function" if self.config.reward else "agent"
        result = agent_result(value, tuple(policies), what)
        sequences = ep.sequences(result.reward, result.rewards)
        if not sequences:
            raise AstraflowError("the agent made no completion request to its endpoint")
        info: dict[str, Scalar] = {
            "requests": float(ep.requests),
            "trajectories": float(len(sequences)),
            "turns": float(ep.turns()),
        }
        info.update(result.info)
        return Episode(sequences=sequences, info=info)


RESERVED_INFO = frozenset({"requests", "trajectories", "turns"})
"""Episode info names the openai_agent workflow sets itself."""
MAX_INFO = 200
"""Info entries an agent may return (an episode carries at most 256)."""


@dataclass(frozen=True)
class AgentResult:
    """What an agent (or its reward function) returned, checked."""

    reward: float | None
    """Reward of every trajectory whose role `rewards` does not name (None: `rewards` names them all)."""
    rewards: dict[str, float]
    """Per-role rewards: role -> reward of that role's trajectories."""
    info: dict[str, Scalar]
    """Episode info, floats: metrics `info/<name>` and `info/<role>/<name>`."""


def _number(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        kind = "not finite" if isinstance(value, float) else "not a number"
        raise AstraflowError(
            f"the {what}'s {where} is {value!r} ({type(value).__name__}), {kind}",
            hint="return a float, or a dict {'reward': float, 'rewards': {role: float}, 'info': {...}}",
        )
    return float(value)


def agent_result(value: Any, roles: tuple[str, ...], what: str = "agent") -> AgentResult:
    """Check what an agent (or reward function) returned: a number (the reward of every trajectory), or a
    dict with `reward` (a number), `rewards` ({role: number}, overriding `reward` for that role's
    trajectories), `info` ({name: number | bool}) and further top-level numbers or booleans, which join
    `info` (booleans as 0.0 / 1.0).
    Anything else is an error naming it: nothing the agent returns is dropped silently."""
    if not isinstance(value, dict):
        return AgentResult(_number(value, "reward", what), {}, {})
    reward = None if value.get("reward") is None else _number(value["reward"], "'reward'", what)
    raw = value.get("rewards") or {}
    if not isinstance(raw, dict):
        raise AstraflowError(f"the {what}'s 'rewards' must be a dict {{role: reward}}, got {raw!r}")
    unknown = sorted(str(r) for r in raw if r not in roles)
    if unknown:
        raise AstraflowError(
            f"the {what}'s 'rewards' name roles {unknown} that this workflow does not have",
            hint=f"its roles: {', '.join(roles)}",
        )
    rewards = {str(r): _number(v, f"reward of role {r!r}", what) for r, v in raw.items()}
    if reward is None and not rewards:
        raise AstraflowError(
            f"the {what} returned a dict without 'reward' or 'rewards' (keys: {sorted(map(str, value))})",
            hint="add 'reward': float, or set workflow.options.reward to score its answer",
        )
    extra = value.get("info") or {}
    if not isinstance(extra, dict):
        raise AstraflowError(f"the {what}'s 'info' must be a dict {{name: number}}, got {extra!r}")
    loose = {k: v for k, v in value.items() if k not in ("reward", "rewards", "info")}
    info: dict[str, Scalar] = {}
    for name, v in [*extra.items(), *loose.items()]:
        if not isinstance(name, str) or not 0 < len(name) <= 255:
            raise AstraflowError(f"the {what}'s info name {name!r} is not a string of 1-255 characters")
        if name in RESERVED_INFO or name in info:
            raise AstraflowError(
                f"the {what}'s info name {name!r} is taken",
                hint=f"{', '.join(sorted(RESERVED_INFO))} are the workflow's own; give each name once",
            )
        if isinstance(v, bool):
            info[name] = float(v)  # metrics are numbers: a flag becomes its rate
        elif isinstance(v, int | float) and math.isfinite(v):
            info[name] = float(v)
        else:
            raise AstraflowError(
                f"the {what} returned {name!r} = {v!r}: info values are finite numbers or booleans "
                "(they become metrics)"
            )
    if len(info) > MAX_INFO:
        raise AstraflowError(f"the {what} returned {len(info)} info entries; at most {MAX_INFO}")
    return AgentResult(reward, rewards, info)

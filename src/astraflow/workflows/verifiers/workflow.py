"""The `verifiers` workflow: any environment of the `verifiers` library runs as an astraflow workflow,
its rubric's score the reward.

The environment is loaded with `verifiers.load_environment(env_id, **env_args)` (the classic API of
verifiers 0.3: `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, ... with a `Rubric`). Each episode runs the
environment's own rollout (`run_rollout`, scoring included) against the policy through a per-episode
OpenAI-compatible endpoint (see workflows/openai/endpoint.py), so every model call it makes is recorded with the
engine's exact tokens, logprobs and versions; the multi-turn trajectory becomes one Sequence.
Tasks are the rows of the environment's dataset (`get_dataset()`), unless the recipe names a file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.common.loopback_http import LoopbackServer
from astraflow.workflows.openai.agent import AgentEndpoint, serve_episode

ROW_KEYS = ("prompt", "answer", "info", "task", "example_id")


class VerifiersConfig(BaseModel):
    """Options of the verifiers workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    env_id: str
    """The environment module (an installed environment package, or a module under `path`)."""
    env_args: dict[str, Any] = {}
    """Keyword arguments of its load_environment."""
    path: str = ""
    """A directory put on sys.path before loading (a local environment module); "" = none."""
    sampling_args: dict[str, Any] = {}
    """Sampling arguments the environment passes on each model call (e.g. max_tokens); the recipe's
    policy.sampling applies to what is not set here."""
    max_tokens: int = Field(4096, ge=16)
    """Context budget of one trajectory."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """A rollout still running after this long fails the episode."""


def _jsonable(value: Any) -> Any:
    # dataset rows travel to the RaaS in the task: keep them plain JSON
    return json.loads(json.dumps(value, default=str))


class VerifiersWorkflow(Workflow):
    """A verifiers environment: its rollout against the policy, its rubric as the reward."""

    Config = VerifiersConfig
    roles = ("actor",)

    def __init__(self, config: VerifiersConfig) -> None:
        super().__init__(config)
        self.config: VerifiersConfig = config
        self.server = LoopbackServer()
        self._env: Any = None

    def env(self) -> Any:
        """The loaded environment (once per process)."""
        if self._env is None:
            try:
                import verifiers
            except ImportError as exc:
                raise AstraflowError(
                    "the verifiers workflow needs the verifiers package",
                    hint="pip install 'astraflow[verifiers]'",
                ) from exc
            if self.config.path:
                path = str(Path(self.config.path).resolve())
                if path not in sys.path:
                    sys.path.insert(0, path)
            try:
                self._env = verifiers.load_environment(self.config.env_id, **self.config.env_args)
            except Exception as exc:
                raise AstraflowError(
                    f"cannot load the verifiers environment {self.config.env_id!r}: {exc}",
                    hint="install its package, or set workflow.options.path to the directory of its module",
                ) from exc
        return self._env

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """The environment's dataset rows (prompt, answer, info, task, example_id)."""
        ds = self.env().get_dataset(n=size or -1, seed=seed)
        for i, row in enumerate(ds):
            out = {k: _jsonable(row[k]) for k in ROW_KEYS if k in row and row[k] is not None}
            out.setdefault("example_id", i)
            yield out

    def _client(self, endpoint: AgentEndpoint) -> Any:
        import openai
        from verifiers.clients import OpenAIChatCompletionsClient, OpenAICompletionsClient

        oai = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        if getattr(self.env(), "message_type", "chat") == "completion":
            return OpenAICompletionsClient(oai)
        return OpenAIChatCompletionsClient(oai)

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """One rollout of the environment, scored by its rubric."""
        env = self.env()
        row = {k: sample[k] for k in ROW_KEYS if k in sample}
        if "prompt" not in row:
            raise AstraflowError("a verifiers task needs a 'prompt' (the environment's dataset format)")
        row.setdefault("example_id", 0)

        async def rollout(endpoint: AgentEndpoint) -> Any:
            client = self._client(endpoint)
            try:
                return await env.run_rollout(row, client, endpoint.model, dict(self.config.sampling_args))
            finally:
                await client.close()

        cfg = self.config
        ep, out = await serve_episode(self.server, policies, cfg.max_tokens, cfg.episode_timeout_s, rollout)
        if out.get("error"):
            raise AstraflowError(f"the verifiers rollout failed: {out['error']}")
        reward = out.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise AstraflowError(f"the verifiers rollout has no numeric reward (got {reward!r})")
        sequences = ep.sequences(float(reward))
        if not sequences:
            raise AstraflowError("the verifiers rollout made no model call")
        info: dict[str, Scalar] = {
            "requests": float(ep.requests),
            "trajectories": float(len(sequences)),
            "turns": float(ep.turns()),
        }
        for name, value in (out.get("metrics") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                info[f"vf_{name}"[:255]] = float(value)
        return Episode(sequences=sequences, info=info)

"""Solver + verifier against an environment with long-tailed latency: the pipeline benchmark's workload.

Each task is a digit string of uneven length (most short, a long tail up to `max_length`); the
solver is asked "copy <digits> =" its group-size times, with room for exactly the answer and a stop
(so generation lengths differ from task to task). Every answer is then run in an environment, an
async tool called through `Tools` (awaited off the RaaS's work, like any async tool of a multi-turn
agent): it checks the answer against the digits (the quickstart's partial credit: the solver's
reward) after a latency drawn from a lognormal distribution (median `env_latency_s`, shape
`env_sigma`, capped at `env_max_s`), seeded by the task and answer, so both modes of a benchmark see
the same latencies. The environment is SIMULATED: its latency is an `asyncio.sleep` standing for a
sandbox, a browser or a remote tool, which keeps the rollout waiting without using a CPU; its check
is real. As soon as an answer's environment call returns, the verifier judges it: asked
"check <digits> : <answer> =", it should say "1" when the environment scored the answer 1.0 and
"0" otherwise (its group-size verdicts per answer, `group_key` = the answer); its reward is the
quickstart's partial credit of its verdict against that truth.

Both policies learn from random init, but the point of the workload is its shape: a lock-step
round waits for its slowest environment call, while asynchronous rollout keeps the other slots and
both trainers busy meanwhile.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.workflows.base import Episode, PolicyClient, Workflow, completion_sequence
from astraflow.workflows.common.tools import Tools
from astraflow.workflows.quickstart.workflow import score

READ_ONLY_VERDICTS = 1
"""Verifier verdicts per answer when the verifier's sequences are not kept (nothing needs more)."""


class VerifyEnvConfig(BaseModel):
    """Options of the solver/verifier workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    min_length: int = Field(1, ge=1, le=32)
    """Fewest digits of a task."""
    max_length: int = Field(8, ge=1, le=32)
    """Most digits of a task (the tail of the length distribution)."""
    length_tail: float = Field(0.5, gt=0, le=1)
    """Each extra digit beyond min_length is added with this probability (a geometric tail)."""
    env_latency_s: float = Field(0.5, ge=0)
    """Median latency of one environment call (simulated: an asyncio sleep)."""
    env_sigma: float = Field(1.0, ge=0)
    """Shape of the lognormal latency: 0 = constant, 1 = p99 about 10x the median."""
    env_max_s: float = Field(10.0, ge=0)
    """Cap on one environment call's latency."""
    size: int = Field(1000, ge=1)
    """Tasks in the generated dataset (used when the recipe's dataset.size is 0)."""


def env_latency(cfg: VerifyEnvConfig, seed: int, answer: int) -> float:
    """The simulated latency of one environment call, the same for the same task seed and answer."""
    if cfg.env_latency_s <= 0:
        return 0.0
    z = random.Random(seed * 1_000_003 + answer).gauss(0.0, 1.0)
    return min(cfg.env_max_s, cfg.env_latency_s * math.exp(cfg.env_sigma * z))


class VerifyEnvWorkflow(Workflow):
    """Roles "solver" and "verifier"; see the module docstring."""

    Config = VerifyEnvConfig
    roles = ("solver", "verifier")

    def __init__(self, config: VerifyEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else VerifyEnvConfig())
        self.config: VerifyEnvConfig
        self.tools = Tools({"run": self._run}, timeout_s=self.config.env_max_s + 30.0)

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """`size` tasks of uneven length, each with the seed of its environment latencies."""
        cfg = self.config
        rng = random.Random(seed)
        top = max(cfg.min_length, cfg.max_length)
        for i in range(size or cfg.size):
            n = cfg.min_length
            while n < top and rng.random() < cfg.length_tail:
                n += 1
            digits = [str(rng.randrange(10)) for _ in range(n)]
            yield {"id": f"verify-{i}", "digits": digits, "env_seed": rng.randrange(1 << 30)}

    @classmethod
    def sequences_per_task(cls, group_sizes: dict[str, int]) -> dict[str, int]:
        """solver: its group size; verifier: its group size for each answer."""
        gs, gv = group_sizes.get("solver", 1), group_sizes.get("verifier", 1)
        return {"solver": gs, "verifier": gs * gv}

    async def _run(self, words: list[str], stopped: bool, digits: list[str], seed: int, answer: int) -> float:
        """The environment: wait its latency, then score the answer."""
        await asyncio.sleep(env_latency(self.config, seed, answer))
        return score(words, stopped, digits)

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """One answer and one verdict (the group form is run_group)."""
        (ep,) = await self.run_group(sample, policies, {"solver": 1, "verifier": 1})
        return ep

    async def run_group(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], group_sizes: dict[str, int]
    ) -> list[Episode]:
        """The solver's group, then per answer: the environment, then the verifier's group on it."""
        solver, verifier = policies["solver"], policies["verifier"]
        digits = [str(d) for d in sample.get("digits", ["0"])]
        seed = int(sample.get("env_seed", 0))
        prompt = list(solver.tokenizer.encode("copy " + " ".join(digits) + " ="))
        answers = await solver.generate(
            prompt, n=group_sizes.get("solver", 1), max_new_tokens=len(digits) + 1
        )
        verdicts_each = group_sizes.get("verifier", 1)
        if verifier.read_only:
            verdicts_each = min(verdicts_each, READ_ONLY_VERDICTS)

        async def one(i: int) -> Episode:
            words, stopped = _words(solver, list(answers[i].token_ids))
            res = await self.tools.call("run", words, stopped, digits, seed, i)
            reward = float(res.value) if res.ok else 0.0
            truth = "1" if reward >= 1.0 else "0"
            vprompt = list(
                verifier.tokenizer.encode("check " + " ".join(digits) + " : " + " ".join(words) + " =")
            )
            verdicts = await verifier.generate(vprompt, n=verdicts_each, max_new_tokens=2)
            seqs = [completion_sequence(solver, prompt, answers[i], reward=reward, role="solver")]
            agree = 0.0
            for v in verdicts:
                vwords, vstopped = _words(verifier, list(v.token_ids))
                r = score(vwords, vstopped, [truth])
                agree += r
                seqs.append(
                    completion_sequence(verifier, vprompt, v, reward=r, role="verifier", group_key=f"a{i}")
                )
            info: dict[str, str | int | float | bool | None] = {
                "solved": 1.0 if reward >= 1.0 else 0.0,
                "length": float(len(digits)),
                "verdict_agree": agree / max(1, len(verdicts)),
            }
            return Episode(sequences=seqs, info=info)

        return list(await asyncio.gather(*(one(i) for i in range(len(answers)))))


def _words(client: PolicyClient, token_ids: list[int]) -> tuple[list[str], bool]:
    """The words generated before the stop token, and whether it stopped."""
    tok = client.tokenizer
    eos = tok.eos_token_id
    stopped = eos is not None and eos in token_ids
    ids = token_ids[: token_ids.index(eos)] if stopped else token_ids
    return tok.decode(ids, skip_special_tokens=True).split(), stopped

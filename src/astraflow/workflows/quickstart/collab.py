"""The proposer/solver workflow: two roles that learn together from random init on a CPU.

Each task: the proposer answers "+ =" with `length` digits (a problem); for each of its proposals
the solver is asked "copy <digits> =" several times. Rewards:

- solver: the quickstart's partial credit for copying the proposed digits (and stopping);
- proposer: half for a well-formed problem (exactly `length` digits, then stop), half for how well
  the solver did on it, so a proposer is paid for problems its partner can solve.

Group sizes are each policy's own: the proposer's group is its `group_size` proposals of the task,
and for each proposal the solver's group is its `group_size` attempts (`group_key` = the proposal),
so the solver's baseline compares attempts at the same problem. With both roles mapped to one policy
(self-play) the two roles get separate baselines (the controller groups by role too).

When the solver's output is not kept for a task (frozen, budget met, or no room), it makes only
READ_ONLY_TRIES attempts per proposal, enough to score the proposer.

With `solver_tokens_median` set, each problem's solver attempts may write a number of tokens drawn
from a lognormal distribution (that median, `solver_tokens_sigma`), capped by the solver's
max_new_tokens: a stand-in for the long-tailed answer lengths of reasoning models, which a randomly
initialised model (it almost never writes its stop token) does not have. The draw depends only on
the task and the proposal's place in it, so a sync and an async run of one recipe see the same
lengths.

An optional third role, "judge", is typically a frozen policy: it answers every problem once as a
fixed reference; its success is reported as episode info `judge_solved` and changes no reward.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.workflows.base import Episode, PolicyClient, Workflow, completion_sequence
from astraflow.workflows.quickstart.workflow import score

READ_ONLY_TRIES = 2
"""Solver attempts per proposal when the solver's sequences are not kept (only its success is needed)."""


class CollabConfig(BaseModel):
    """Options of the proposer/solver workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    length: int = Field(1, ge=1, le=8)
    """Digits of a proposed problem."""
    size: int = Field(1000, ge=1)
    """Tasks in the generated dataset (used when the recipe's dataset.size is 0)."""
    solver_weight: float = Field(0.5, ge=0, le=1)
    """Share of the proposer's reward that comes from the solver's success on its problem."""
    solver_tokens_median: int = Field(0, ge=0)
    """0: every solver attempt may write the solver's max_new_tokens. > 0: each problem's attempts
    may write a lognormal draw of tokens with this median (at least 1, at most max_new_tokens)."""
    solver_tokens_sigma: float = Field(1.0, gt=0, le=4)
    """The spread (sigma of the log) of the draw that `solver_tokens_median` turns on."""


def solver_budget(config: CollabConfig, fill_seed: int, index: int, cap: int) -> int | None:
    """The tokens the solver may write on the task's `index`-th problem: None (the recipe's
    max_new_tokens) unless `solver_tokens_median` is set, else a lognormal draw in [1, cap] seeded by
    the task and the index alone."""
    if not config.solver_tokens_median:
        return None
    rng = random.Random(f"{fill_seed}:{index}")
    draw = rng.lognormvariate(math.log(config.solver_tokens_median), config.solver_tokens_sigma)
    return max(1, min(cap, round(draw)))


def _max_new_tokens(client: PolicyClient) -> int:
    """The max_new_tokens a generate call of this client gets without an override of its own (the
    cap of a drawn budget): the task's (an evaluation task may set one), else the recipe's."""
    task = (getattr(client, "defaults", None) or {}).get("max_new_tokens")
    if task is not None:
        return int(task)
    sampling = getattr(client, "sampling", None)
    if sampling is None:
        raise TypeError(
            f"solver_tokens_median needs a policy client with the recipe's sampling settings "
            f"(`.sampling`); {type(client).__name__} has none"
        )
    return int(sampling.max_new_tokens)


def _words(client: PolicyClient, token_ids: list[int]) -> tuple[list[str], bool]:
    """The words generated before the stop token, and whether it stopped."""
    tok = client.tokenizer
    eos = tok.eos_token_id
    stopped = eos is not None and eos in token_ids
    ids = token_ids[: token_ids.index(eos)] if stopped else token_ids
    return tok.decode(ids, skip_special_tokens=True).split(), stopped


class CollabWorkflow(Workflow):
    """Roles "proposer" and "solver"; see the module docstring."""

    Config = CollabConfig
    roles = ("proposer", "solver")
    optional_roles = ("judge",)

    def __init__(self, config: CollabConfig | None = None) -> None:
        super().__init__(config if config is not None else CollabConfig())
        self.config: CollabConfig

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """`size` tasks; each carries a seed that fills a malformed proposal with digits."""
        rng = random.Random(seed)
        for i in range(size or self.config.size):
            yield {"id": f"collab-{i}", "prompt": "+ =", "fill_seed": rng.randrange(1 << 30)}

    @classmethod
    def sequences_per_task(cls, group_sizes: dict[str, int]) -> dict[str, int]:
        """proposer: its group size; solver: its group size for each proposal."""
        gp, gs = group_sizes.get("proposer", 1), group_sizes.get("solver", 1)
        out = {"proposer": gp, "solver": gp * gs}
        if "judge" in group_sizes:
            out["judge"] = gp
        return out

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """One proposal and one solver attempt (the group form is run_group)."""
        (ep,) = await self.run_group(sample, policies, {"proposer": 1, "solver": 1})
        return ep

    async def run_group(
        self, sample: dict[str, Any], policies: dict[str, PolicyClient], group_sizes: dict[str, int]
    ) -> list[Episode]:
        """The proposer's group, then the solver's group on each proposal; one Episode per proposal."""
        proposer, solver = policies["proposer"], policies["solver"]
        n = self.config.length
        prompt = list(proposer.tokenizer.encode(str(sample.get("prompt", "+ ="))))
        proposals = await proposer.generate(prompt, n=group_sizes.get("proposer", 1))
        fill_seed = int(sample.get("fill_seed", 0))
        rng = random.Random(fill_seed)
        problems: list[tuple[list[str], float]] = []
        for c in proposals:
            words, stopped = _words(proposer, list(c.token_ids))
            well_formed = [w for w in words[:n] if w.isdigit() and len(w) == 1]
            digits = (well_formed + [str(rng.randrange(10)) for _ in range(n)])[:n]
            # format credit: each position a digit, and the stop right after the last one
            fmt = score([w if w.isdigit() and len(w) == 1 else "x" for w in words], stopped, digits)
            problems.append((digits, fmt))
        # a read-only solver (frozen, or its budget met) only scores the proposals: two tries each do
        tries_each = group_sizes.get("solver", 1)
        if solver.read_only:
            tries_each = min(tries_each, READ_ONLY_TRIES)
        cap = _max_new_tokens(solver) if self.config.solver_tokens_median else 0
        budgets = [solver_budget(self.config, fill_seed, i, cap) for i in range(len(problems))]
        attempts = await asyncio.gather(
            *(
                solver.generate(
                    list(solver.tokenizer.encode("copy " + " ".join(d) + " =")),
                    n=tries_each,
                    **({} if b is None else {"max_new_tokens": b}),
                )
                for (d, _), b in zip(problems, budgets, strict=True)
            )
        )
        judge = policies.get("judge")
        verdicts = []
        if judge is not None:
            verdicts = await asyncio.gather(
                *(
                    judge.generate(list(judge.tokenizer.encode("copy " + " ".join(d) + " =")), n=1)
                    for d, _ in problems
                )
            )
        episodes = []
        for i, (c, (digits, fmt), tries) in enumerate(zip(proposals, problems, attempts, strict=True)):
            sprompt = list(solver.tokenizer.encode("copy " + " ".join(digits) + " ="))
            solver_seqs = []
            for t in tries:
                words, stopped = _words(solver, list(t.token_ids))
                solver_seqs.append(
                    completion_sequence(
                        solver,
                        sprompt,
                        t,
                        reward=score(words, stopped, digits),
                        role="solver",
                        group_key=f"p{i}",
                    )
                )
            solved = sum(s.reward for s in solver_seqs) / len(solver_seqs)
            w = self.config.solver_weight
            reward = (1 - w) * fmt + w * solved
            info: dict[str, str | int | float | bool | None] = {
                "well_formed": 1.0 if fmt >= 1.0 else 0.0,
                "solved": solved,
            }
            seqs = [completion_sequence(proposer, prompt, c, reward=reward, role="proposer"), *solver_seqs]
            if judge is not None:
                (v,) = verdicts[i]
                words, stopped = _words(judge, list(v.token_ids))
                judge_solved = score(words, stopped, digits)
                info["judge_solved"] = judge_solved
                jprompt = list(judge.tokenizer.encode("copy " + " ".join(digits) + " ="))
                seqs.append(completion_sequence(judge, jprompt, v, reward=judge_solved, role="judge"))
            episodes.append(Episode(sequences=seqs, info=info))
        return episodes

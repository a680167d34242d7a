"""Result validation counts each policy's sequences against the task's per-policy shape.

Real recipe (recipes/collab/with-judge.toml: proposer group 8, solver 16, a frozen judge), the real
collab workflow's shape, the real ResultChecker; the episodes are built here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel

from astraflow.config.load import load_recipe
from astraflow.config.recipe import Recipe
from astraflow.dataflow.validate import ResultChecker
from astraflow.protocol.messages import Episode, SamplingParams, Sequence
from astraflow.workflows.base import PolicyClient, Workflow
from astraflow.workflows.quickstart.collab import CollabWorkflow

COLLAB = Path(__file__).resolve().parents[2] / "recipes/collab"
ROLES = {"proposer": "proposer", "solver": "solver", "judge": "fixed"}


def _seq(policy: str) -> Sequence:
    return Sequence(
        policy=policy,
        tokens=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.2],
        versions=[-1, 0, 0],
        sampling=SamplingParams(),
    )


def _result(proposals: int, tries: int) -> list[Episode]:
    return [
        Episode(sequences=[_seq("proposer"), *(_seq("solver") for _ in range(tries)), _seq("fixed")])
        for _ in range(proposals)
    ]


def _expected() -> dict[str, int]:
    per_role = CollabWorkflow.sequences_per_task({"proposer": 8, "solver": 16, "judge": 4})
    return {ROLES[r]: n for r, n in per_role.items()}


def test_unequal_group_sizes_are_checked_per_policy() -> None:
    checker = ResultChecker(load_recipe(COLLAB / "with-judge.toml"))
    latest = {"proposer": 0, "solver": 0, "fixed": 0}

    def check(episodes: list[Episode]) -> str:
        return checker.check(episodes, expected=_expected(), roles=ROLES, latest=latest)

    # 8 episodes (one a proposal) while the largest group is 16: what the task asks, accepted
    assert check(_result(8, 16)) == ""
    # fewer is fine: a read-only solver tries less, and a workflow may skip a role on some tasks
    assert check(_result(8, 2)) == ""
    only_proposer = [Episode(sequences=[_seq("proposer")]) for _ in range(8)]
    assert check(only_proposer) == ""
    # more than asked is refused, read-only or not, and the message names the contract
    assert "9 sequences of policy" in check(_result(9, 16))
    assert "sequences_per_task" in check(_result(8, 17))
    assert "'fixed'" in check(_result(8, 16) + [Episode(sequences=[_seq("fixed")])])
    assert check([]) == "0 episodes"


class _NoOptions(BaseModel):
    pass


class _SkipB(Workflow):
    """A third-party shape: role b is asked only on even tasks (a workflow, not a fake: it calls no model)."""

    Config = _NoOptions
    roles = ("a", "b")

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        yield from ({"i": i} for i in range(size))

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        seqs = [_seq(policies["a"].policy)]
        if sample["i"] % 2 == 0:
            seqs.append(_seq(policies["b"].policy))
        return Episode(sequences=seqs)


def test_a_workflow_that_skips_a_role_on_some_tasks_gives_valid_results() -> None:
    """Default run_group with group sizes 4 (a) and 8 (b): on a task without b, episodes 4-7 held only
    a's trimmed sequences; they used to be returned empty and the whole result was refused."""
    checker = ResultChecker(
        Recipe.model_validate(
            {"policy": [{"name": "pa", "model": "no-such-dir"}, {"name": "pb", "model": "no-such-dir"}]}
        )
    )
    roles = {"a": "pa", "b": "pb"}
    clients = {r: SimpleNamespace(policy=p) for r, p in roles.items()}
    wf = _SkipB(_NoOptions())
    for i, want in ((0, {"pa": 4, "pb": 8}), (1, {"pa": 4})):
        eps = asyncio.run(wf.run_group({"i": i}, clients, {"a": 4, "b": 8}))  # type: ignore[arg-type]
        got: dict[str, int] = {}
        for ep in eps:
            for s in ep.sequences:
                got[s.policy] = got.get(s.policy, 0) + 1
        assert got == want and all(ep.sequences for ep in eps)
        expected = {"pa": 4, "pb": 8}
        assert checker.check(eps, expected=expected, roles=roles, latest={"pa": 0, "pb": 0}) == ""


def test_the_stall_report_says_why_results_are_refused(tmp_path: Path) -> None:
    """A workflow whose every result is refused stalls the run; the stall line carries the refusal."""
    from astraflow.dataflow.stall import last_task_failure
    from astraflow.state.ledger import Ledger
    from astraflow.state.store import Store

    store = Store.open(tmp_path / "s.db")
    led = Ledger(store)
    led.enqueue("k", {}, {"a": "pa"}, 4)
    ctl = SimpleNamespace(store=store)
    assert last_task_failure(ctl) == ""
    (t,) = led.lease("w", 1)
    why = "invalid result: 5 sequences of policy 'pa' in 5 episodes, the task asks for at most 4"
    assert led.fail(t.id, t.epoch, "w", why) == "requeued"
    assert last_task_failure(ctl) == why

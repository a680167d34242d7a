"""Helpers of the tests that drive a real Controller on a real state.db through `Controller.dispatch`
with no sockets: a started controller with one RaaS member ("w") already welcomed (the tests that
compare what one TaskResults stores with what one TaskResult each stores), and the SQL a message ran."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.state.store import Store


def started_controller(model: Path, run_dir: Path, *, name: str, group: int, **policy: Any) -> Controller:
    """The quickstart workflow, one policy "main" of `model` with groups of `group`, 4 prompts a step,
    staleness 4, 8 slots; `policy` adds or overrides the policy's fields."""
    recipe = Recipe.model_validate(
        {
            "run": {"name": name, "steps": 3, "seed": 0},
            "policy": [
                {
                    "name": "main",
                    "model": str(model),
                    "group_size": group,
                    "batch_prompts": 4,
                    "max_staleness": 4,
                    **policy,
                }
            ],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"slots": 8},
        }
    )
    c = Controller(recipe, run_dir, Store.open(run_dir / "state.db"))
    c.start()
    hello = m.Hello(
        member_id="w", role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
    )
    assert isinstance(c.dispatch(b"w", hello)[0][1], m.Welcome)
    return c


def grant(c: Controller, n: int) -> list[m.Task]:
    """Lease n tasks to "w" (all n must be granted)."""
    reply = c.dispatch(b"w", m.TaskRequest(n=n, loaded={"main": 0}))[0][1]
    assert isinstance(reply, m.TaskGrant) and len(reply.tasks) == n, reply
    return list(reply.tasks)


def stored(c: Controller) -> list[tuple[Any, ...]]:
    """Every trajectory row's id, task, reward, advantage, status, length and min_version, by id."""
    rows = c.store.query(
        "SELECT id, task_id, reward, advantage, status, length, min_version FROM trajectories ORDER BY id"
    )
    return [tuple(r) for r in rows]


@contextmanager
def traced(store: Store) -> Iterator[list[str]]:
    """The SQL statements the store's connection runs inside the block, in order."""
    seen: list[str] = []
    store.conn.set_trace_callback(seen.append)
    try:
        yield seen
    finally:
        store.conn.set_trace_callback(None)

"""The Hello handler and the periodic work (roles/controller/members.py, lifecycle.py) called with the
parts they are handed alone: no `Controller`, no sockets, a real state.db. The same paths through
`Controller.dispatch` and `tick` are tests/unit/test_long_polls.py and tests/security/."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import lifecycle, members
from astraflow.roles.controller.beat_pace import BeatPace
from astraflow.roles.controller.core import ControllerCore
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.member_sections import WelcomeSections
from astraflow.roles.member_table import MemberTable
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store


def _recipe(**controller: float) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "parts", "steps": 3},
            "policy": [{"name": "main", "model": "unused", "group_size": 2, "batch_prompts": 1}],
            "workflow": {"name": "quickstart", "options": {"size": 20}},
            "controller": controller,
        }
    )


def _hello(ident: str, role: str, *, pid: int = 1, policies: tuple[str, ...] = ("main",)) -> m.Hello:
    return m.Hello(
        rid=3,
        member_id=ident,
        role=role,
        protocol=m.PROTOCOL_VERSION,
        policies=list(policies),
        pid=pid,
        host="h",
    )


def test_hello_joins_with_its_parts_alone(tmp_path: Path) -> None:
    """`on_hello` over a `Joining` built here from a store, a ledger, a member table, the versions and
    the Welcome's sections: it registers the member, sends its role's sections, refuses an unknown
    policy, and a new process under a draining id is no longer draining."""
    recipe = _recipe(heartbeat_interval_s=0.7)
    store = Store.open(tmp_path / "state.db")
    store.init_run("parts", recipe.model_dump(mode="json"))
    store.ensure_policy("main", 1)
    table = MemberTable(store)
    draining: set[str] = set()
    ctx = members.Joining(
        store=store,
        ledger=Ledger(store),
        members=table,
        draining=draining,
        versions=PolicyVersions(store, {"main": 3}, relays=False, member_timeout_s=5.0),
        sections=WelcomeSections(recipe, {"main": "main"}),
        run_name="parts",
        policies=["main"],
        member_timeout_s=5.0,
        heartbeat_interval_s=0.7,
        pace=BeatPace(0.7, 1000.0),
    )

    done = members.on_hello(ctx, b"trainer-main", _hello("trainer-main", "trainer"))
    welcome = done.reply
    assert isinstance(welcome, m.Welcome) and welcome.rid == 3 and done.void == b"trainer-main"
    assert welcome.run_name == "parts" and welcome.heartbeat_interval_s == 0.7
    assert welcome.sections["policy"]["name"] == "main"  # a trainer's sections: its own policy
    row = store.member("trainer-main")
    assert row is not None and row["role"] == "trainer" and row["status"] == "alive"
    assert table.row("trainer-main") is not None

    refused = members.on_hello(ctx, b"w", _hello("w", "raas", policies=("other",))).reply
    assert isinstance(refused, m.Error) and store.member("w") is None

    # a second process under a live id is refused; once the first fell silent (its last heartbeat,
    # still in the member table's memory, is written before the check reads it) it may take the id
    second = _hello("trainer-main", "trainer", pid=2)
    assert isinstance(members.on_hello(ctx, b"trainer-main", second).reply, m.Error)
    table.touch("trainer-main", time.time() - 60.0)
    draining.add("trainer-main")
    again = members.on_hello(ctx, b"trainer-main", second).reply
    assert isinstance(again, m.Welcome) and "trainer-main" not in draining


def test_the_periodic_work_runs_with_its_parts_alone(tmp_path: Path) -> None:
    """`tick` over a `Ticking` (the parts taken from a `ControllerCore`, which has no routing and no
    held requests) declares a silent member dead and returns it; past stall_fail_s it sets the loop's
    exit code and stop flag; `should_exit` waits for the run's end."""
    recipe = _recipe(member_timeout_s=2.0, stall_warn_s=5.0, stall_fail_s=10.0)
    core = ControllerCore(recipe, tmp_path, Store.open(tmp_path / "state.db"))
    loop = lifecycle.LoopState()
    lifecycle.start(
        lifecycle.Starting(
            recipe=recipe,
            allow_recipe_change=False,
            store=core.store,
            members=core.members,
            evals=core.evals,
            sinks=core.sinks,
            run=core.run,
            queue=core.queue,
            run_dir=tmp_path,
        )
    )
    assert core.store.run() is not None and core.ledger.counts().get("queued", 0) > 0  # refilled
    stalls = lifecycle.Stalls(
        recipe=recipe,
        store=core.store,
        admission=core.admission,
        buffer=core.buffer,
        ledger=core.ledger,
        roles=core.roles,
        group_sizes=core.group_sizes,
        task_policies=core.task_policies,
        progress=core.progress,
        warn_s=5.0,
        fail_s=10.0,
    )
    ctx = lifecycle.Ticking(
        store=core.store,
        ledger=core.ledger,
        members=core.members,
        accounting=core.accounting,
        versions=core.policy_versions,
        run=core.run,
        control=core.control,
        queue=core.queue,
        evals=core.evals,
        sinks=core.sinks,
        progress=core.progress,
        stalls=stalls,
        loop=loop,
        member_timeout_s=2.0,
        heartbeat_interval_s=0.5,
        forget_after_s=3600.0,
        pace=BeatPace(0.5, 1000.0),
    )
    t0 = core.progress.last
    core.store.upsert_member("w", "raas", policies=["main"], pid=1, host="h")
    core.members.joined("w", t0)

    assert lifecycle.tick(ctx, t0 + 1.0) == []  # silent 1 s of 2: alive
    assert lifecycle.tick(ctx, t0 + 3.0) == ["w"]
    row = core.store.member("w")
    assert row is not None and row["status"] == "dead"
    assert not loop.stop_requested and loop.exit_code == 0

    lifecycle.tick(ctx, t0 + 6.0)  # a stall: warned, not failed
    assert [e for e in core.store.events() if e["kind"] == "stall"] and not loop.stop_requested
    lifecycle.tick(ctx, t0 + 11.0)
    assert loop.stop_requested and loop.exit_code == 1
    assert [e for e in core.store.events() if e["kind"] == "stall_fail"]
    assert not lifecycle.should_exit(ctx, t0 + 11.0)  # stopping on a stall is not the run's end

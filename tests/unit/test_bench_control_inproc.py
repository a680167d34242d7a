"""`bench control --in-process` drives a real Controller on a real state.db through whole steps: every
result is accepted, every step's batch holds the bench's 32 x 16 sequences, and the figures add up."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from astraflow.bench import control_inproc


def test_in_process_steps_move_whole_batches() -> None:
    r = control_inproc.run(steps=2, warmup_steps=1, tokens=3, profile=True, top=5)
    assert r["sequences"] == 2 * 32 * 16
    # per step: a task request and a TaskResults per worker, the batch request, the version
    assert r["messages"] == 2 * 6
    assert r["controller_cpu_s"] > 0
    assert abs(r["us_per_sequence"] * r["sequences"] / 1e6 - r["controller_cpu_s"]) < 1e-3
    assert "function calls" in r["profile"]
    assert "us/sequence" in control_inproc.render(r)


def test_another_step_shape_moves_its_own_batches() -> None:
    from astraflow.bench.control_recipe import Shape

    r = control_inproc.run(steps=2, warmup_steps=1, tokens=3, shape=Shape(group_size=4, batch_prompts=8))
    assert r["sequences"] == 2 * 8 * 4 and (r["group_size"], r["batch_prompts"]) == (4, 8)
    assert r["messages"] == 2 * 6  # as at 32 x 16: two task requests, their results, the batch, the version
    assert "(8 tasks x 4)" in control_inproc.render(r)
    with pytest.raises(ValueError, match="group size and prompts >= 1"):
        Shape(group_size=0).check()
    with pytest.raises(ValueError, match="slots >= 0"):
        Shape(slots=-1).check()


def test_workers_asking_for_fewer_tasks_send_more_messages_for_the_same_batches() -> None:
    from astraflow.bench.control_recipe import Shape

    r = control_inproc.run(
        steps=2, warmup_steps=1, tokens=3, shape=Shape(group_size=4, batch_prompts=8, slots=2)
    )
    assert r["sequences"] == 2 * 8 * 4
    # per step: 8 tasks asked for and answered 2 at a time (4 requests, 4 results messages), and the
    # trainer asks once the 32 sequences are in: one batch request, one version
    assert r["messages"] == 2 * (4 + 4 + 2)


def test_the_bench_settles_the_heap_as_run_controller_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from astraflow.roles.controller import process

    calls: list[int] = []

    def settle() -> None:
        calls.append(1)
        real()

    real = process.settle_heap
    monkeypatch.setattr(process, "settle_heap", settle)
    control_inproc.run(steps=1, warmup_steps=0, tokens=3)
    assert calls == [1] and gc.get_freeze_count() == 0  # frozen while the controller ran, thawed after


def test_settle_heap_takes_what_lives_now_out_of_full_collections() -> None:
    from astraflow.roles.controller.core import settle_heap

    class Node:
        me: object = None

    before = Node()
    before.me = before  # a cycle alive when the controller has started
    try:
        settle_heap()
        assert not any(o is before for o in gc.get_objects())  # no collection walks it any more
        after = Node()
        after.me = after
        assert any(o is after for o in gc.get_objects())  # made per message: collected as before
    finally:
        gc.unfreeze()


def test_run_controller_settles_the_heap_after_start_and_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    from astraflow.bench.control import recipe
    from astraflow.config.recipe import Recipe
    from astraflow.roles.controller import process, service
    from astraflow.transport import server as transport

    steps: list[str] = []

    class Served:
        address = "tcp://127.0.0.1:1"

        def __init__(self, *_a: Any, **_k: Any) -> None:
            steps.append("bind")

        def close(self) -> None:
            pass

    def serve(self: service.Controller, _server: Any) -> int:
        steps.append("serve")
        return 0

    real_start = service.Controller.start

    def start(self: service.Controller) -> None:
        real_start(self)
        steps.append("start")

    monkeypatch.setattr(transport, "RouterServer", Served)
    monkeypatch.setattr(service.Controller, "start", start)
    monkeypatch.setattr(service.Controller, "serve", serve)
    monkeypatch.setattr(process, "settle_heap", lambda: steps.append("settle"))
    monkeypatch.setattr(signal, "signal", lambda *_a: None)  # the test process keeps its handlers
    assert process.run_controller(Recipe.model_validate(recipe(0.5, 1)), tmp_path) == 0
    assert steps == ["start", "settle", "bind", "serve"]


def test_in_process_retention_keeps_state_small_and_costs_its_passes() -> None:
    kept = control_inproc.run(steps=24, warmup_steps=0, tokens=3, keep_steps=5)
    every = control_inproc.run(steps=24, warmup_steps=0, tokens=3)
    assert every["trajectories_in_db"] >= 24 * 32 * 16  # every batch's, and those buffered for the next
    # the passes at steps 10 and 20 took those consumed 5 or more steps before: steps 1 to 15
    assert kept["trajectories_in_db"] <= every["trajectories_in_db"] - 15 * 32 * 16
    assert "retention keeping 5 steps" in control_inproc.render(kept)
    # the sizes it reports: what left state.db is in the archive's files, and nothing is without it
    assert kept["archive_mb"] > 0 == every["archive_mb"]
    assert 0 < kept["state_db_mb"] < every["state_db_mb"]
    assert f"archive {kept['archive_mb']:.1f} MB" in control_inproc.render(kept)

"""`bench control --in-process` drives a real Controller on a real state.db through whole steps: every
result is accepted, every step's batch holds the bench's 32 x 16 sequences, and the figures add up."""

from __future__ import annotations

import gc

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


def test_the_bench_settles_the_heap_as_run_controller_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from astraflow.roles.controller import service

    calls: list[int] = []

    def settle() -> None:
        calls.append(1)
        real()

    real = service.settle_heap
    monkeypatch.setattr(service, "settle_heap", settle)
    control_inproc.run(steps=1, warmup_steps=0, tokens=3)
    assert calls == [1] and gc.get_freeze_count() == 0  # frozen while the controller ran, thawed after


def test_settle_heap_takes_what_lives_now_out_of_full_collections() -> None:
    from astraflow.roles.controller.service import settle_heap

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

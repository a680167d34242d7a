"""The autoscaler's policy: bounds, the add and drain conditions, window, cooldown, a pool in motion,
and which worker is drained."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from astraflow.config.recipe import AutoscaleConfig
from astraflow.launch.autoscale import Autoscaler, Decision, idlest, overdue


def demand(queued: int, leased: dict[str, int], slots: int = 2) -> dict[str, Any]:
    """A status document's demand section for workers with `slots` each."""
    workers = [{"id": w, "slots": slots, "leased": n, "quarantined": False} for w, n in leased.items()]
    busy = sum(min(n, slots) for n in leased.values())
    total = slots * len(leased)
    return {
        "queued": queued,
        "leased": sum(leased.values()),
        "slots": total,
        "busy_slots": busy,
        "workers": workers,
    }


def scaler(**kw: Any) -> Autoscaler:
    base = {"enabled": True, "min": 1, "max": 3, "window_s": 10, "cooldown_s": 30}
    return Autoscaler(AutoscaleConfig(**{**base, **kw}))


def test_adds_a_worker_only_after_work_waited_a_whole_window() -> None:
    a = scaler()
    busy = demand(5, {"raas-0": 2})
    assert a.decide(busy, ["raas-0"], 0, 100.0).action == "hold"
    assert a.decide(busy, ["raas-0"], 0, 109.0).action == "hold"
    d = a.decide(busy, ["raas-0"], 0, 110.0)
    assert d.action == "add" and "5 tasks queued" in d.reason
    # cooldown: the same pressure right after does not add another
    assert a.decide(busy, ["raas-0", "raas-1"], 0, 125.0).action == "hold"


def test_a_gap_in_the_pressure_restarts_the_window() -> None:
    a = scaler()
    assert a.decide(demand(5, {"raas-0": 2}), ["raas-0"], 0, 100.0).action == "hold"
    assert a.decide(demand(0, {"raas-0": 2}), ["raas-0"], 0, 105.0).action == "hold"
    assert a.decide(demand(5, {"raas-0": 2}), ["raas-0"], 0, 111.0).action == "hold"
    assert a.decide(demand(5, {"raas-0": 2}), ["raas-0"], 0, 121.0).action == "add"


def test_queued_tasks_with_free_slots_are_not_pressure() -> None:
    # the tasks wait on the staleness bound (or a paused admission), not on workers
    a = scaler(window_s=0)
    assert a.decide(demand(5, {"raas-0": 1, "raas-1": 0}), ["raas-0", "raas-1"], 0, 100.0).action != "add"


def test_drains_the_idlest_worker_when_slots_idle_and_never_below_min() -> None:
    a = scaler(window_s=0, cooldown_s=0)
    d = a.decide(demand(0, {"raas-0": 2, "raas-1": 0, "raas-2": 1}), ["raas-0", "raas-1", "raas-2"], 0, 1.0)
    assert (d.action, d.member) == ("remove", "raas-1")
    # queued tasks no idle worker leases (paused admission) do not keep idle workers
    d = a.decide(demand(4, {"raas-0": 0, "raas-2": 0}), ["raas-0", "raas-2"], 0, 2.0)
    assert (d.action, d.member) == ("remove", "raas-2")  # the newest of equals
    assert a.decide(demand(0, {"raas-0": 0}), ["raas-0"], 0, 3.0).action == "hold"


def test_a_pool_in_motion_holds_and_bounds_come_first() -> None:
    a = scaler(window_s=0, cooldown_s=0, min=2)
    # below min: add at once, whatever the demand
    assert a.decide(demand(0, {"raas-0": 0}), ["raas-0"], 0, 1.0).action == "add"
    # a worker still starting (or draining): nothing changes
    assert a.decide(demand(9, {"raas-0": 2, "raas-1": 2}), ["raas-0", "raas-1"], 1, 2.0).action == "hold"
    d = scaler(max=1).decide(demand(0, {"raas-0": 0, "raas-1": 1}), ["raas-0", "raas-1"], 0, 1.0)
    assert (d.action, d.member) == ("remove", "raas-0")


def test_idlest_counts_an_unlisted_worker_as_holding_nothing() -> None:
    assert idlest(demand(0, {"raas-0": 1}), ["raas-0", "raas-5"]) == "raas-5"


def test_bounds_are_validated() -> None:
    with pytest.raises(ValidationError, match="min .* is larger than max"):
        AutoscaleConfig(min=3, max=2)
    with pytest.raises(ValidationError):
        AutoscaleConfig(up_busy_fraction=1.5)


def test_autoscale_bounds_may_change_on_a_restarted_run() -> None:
    from astraflow.config.recipe_change import check_recipe_change
    from astraflow.errors import RecipeError

    old = {"rollout": {"slots": 4}}  # a run stored before rollout.autoscale existed
    new = {"rollout": {"slots": 4, "autoscale": {"enabled": True, "max": 8}}}
    assert check_recipe_change(old, new, allow=True)
    grown = {"rollout": {"slots": 4, "autoscale": {"enabled": True, "max": 16}}}
    assert check_recipe_change(new, grown, allow=True)
    with pytest.raises(RecipeError):
        check_recipe_change(new, grown, allow=False)


def test_tasks_of_paused_policies_do_not_call_for_workers() -> None:
    # every slot busy and five tasks queued, but admission is paused for all of them: a new worker
    # would lease none, so none is added (and one that idles is drained)
    a = scaler(window_s=0, cooldown_s=0)
    paused = {**demand(5, {"raas-0": 2}), "waiting": 0}
    assert a.decide(paused, ["raas-0"], 0, 1.0).action == "hold"
    assert a.decide({**paused, "waiting": 1}, ["raas-0"], 0, 2.0).action == "add"
    idle = {**demand(5, {"raas-0": 2, "raas-1": 0}), "waiting": 0}
    assert a.decide(idle, ["raas-0", "raas-1"], 0, 3.0) == Decision("remove", "2/4 slots idle", "raas-1")


def test_a_pool_in_motion_holds_and_an_overdue_drain_is_named() -> None:
    a = scaler(window_s=0, cooldown_s=0)
    busy = demand(5, {"raas-0": 2})
    # raas-1 was started and the controller does not list it yet: hold
    assert a.decide_pool(busy, ["raas-0", "raas-1"], {}, 1.0).action == "hold"
    # raas-1 is draining: hold, whatever the demand
    both = demand(5, {"raas-0": 2, "raas-1": 0})
    assert a.decide_pool(both, ["raas-0", "raas-1"], {"raas-1": 0.5}, 2.0).action == "hold"
    assert a.decide_pool(busy, ["raas-0"], {}, 3.0).action == "add"
    assert overdue({"raas-1": 100.0, "raas-2": 130.0}, 140.0, drain_timeout_s=5) == ["raas-1"]

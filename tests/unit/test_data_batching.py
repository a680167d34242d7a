"""Buffer and batching stages: replay fraction, staleness admission, EDF order."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from astraflow import plugins
from astraflow.data.base import AdmissionStage, BufferItem, Stage
from astraflow.data.order import EdfOrder, FifoOrder
from astraflow.data.replay import ReplayComposer, ReplayConfig
from astraflow.data.staleness import StalenessAdmission, StalenessConfig


def test_replay_count_is_floor_of_ratio_times_batch() -> None:
    r = ReplayComposer(ReplayConfig(ratio=0.3))
    assert [r.replay_count(b) for b in (0, 1, 3, 4, 10, 256)] == [0, 0, 0, 1, 3, 76]
    assert r.metrics() == {"replayed": 0.0}  # asking is pure: admission asks too
    r.on_batch(76)
    r.on_batch(4)
    assert r.metrics() == {"replayed": 80.0}
    assert ReplayComposer(ReplayConfig(ratio=0.29)).replay_count(100) == 29  # not 28 from 28.999...
    assert ReplayComposer(ReplayConfig(ratio=0.0)).replay_count(64) == 0
    with pytest.raises(ValidationError):
        ReplayConfig(ratio=1.0)
    s = ReplayComposer()
    s.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert s.metrics() == r.metrics()


@settings(max_examples=200, deadline=None)
@given(ratio=st.floats(0, 0.999), batch=st.integers(0, 10_000))
def test_property_replay_never_exceeds_its_fraction(ratio: float, batch: int) -> None:
    n = ReplayComposer(ReplayConfig(ratio=ratio)).replay_count(batch)
    exact = Decimal(repr(ratio)) * batch
    assert 0 <= n <= exact and n > exact - 1 and n < max(batch, 1)


def test_staleness_admission_budget() -> None:
    s = StalenessAdmission(StalenessConfig(max_staleness=2), policy="main")
    assert isinstance(s, AdmissionStage) and s.kind == "admission"
    assert s.max_staleness == 2
    # (2 + 1) batches of 4 groups may be outstanding.
    assert s.budget(0, 4) == 12 and s.budget(11, 4) == 1 and s.budget(12, 4) == 0 and s.budget(50, 4) == 0
    assert s.admit(11, 4) and not s.admit(12, 4)
    assert s.metrics() == {"admitted": 1.0, "held": 1.0, "max_staleness": 2.0}
    s.bind(1)  # the tighter of the stage's and the policy's bound
    assert s.max_staleness == 1 and not s.admit(8, 4)
    p = StalenessAdmission()
    assert p.max_staleness == 1  # unbound default
    p.bind(4)
    assert p.max_staleness == 4 and p.budget(0, 2) == 10
    p.bind(0)
    assert p.budget(0, 3) == 3  # on-policy: one batch at a time


def test_admission_keeps_every_consumed_group_within_bound() -> None:
    """Simulate admit-then-consume: a group admitted at version v is consumed at version <= v + bound."""
    for bound in (0, 1, 3):
        s = StalenessAdmission(StalenessConfig(max_staleness=bound))
        batch, version, queue = 4, 0, []
        for _ in range(50):
            while s.admit(len(queue), batch):
                queue.append(version)
            consumed, queue = queue[:batch], queue[batch:]
            assert all(version - v <= bound for v in consumed)
            version += 1


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 1000)), min_size=1, max_size=40, unique_by=lambda t: t[1]
    )
)
def test_property_edf_sorts_by_min_version_then_arrival(pairs: list[tuple[int, int]]) -> None:
    items = [BufferItem(i, i, mv, arr, 0.0, 0.0, 1) for i, (mv, arr) in enumerate(pairs)]
    edf = sorted(items, key=EdfOrder().sort_key)
    assert [(x.min_version, x.arrival) for x in edf] == sorted((x.min_version, x.arrival) for x in items)
    fifo = sorted(items, key=FifoOrder().sort_key)
    assert [x.arrival for x in fifo] == sorted(x.arrival for x in items)


@pytest.mark.parametrize(
    "name",
    [
        "greso",
        "filter_solved",
        "curriculum",
        "dynamic_sampling",
        "length_filter",
        "format_filter",
        "replay",
        "staleness",
        "edf",
        "fifo",
    ],
)
def test_builtins_load_through_entry_points_with_documented_config(name: str) -> None:
    cls = plugins.load("data", name)
    assert issubclass(cls, Stage) and cls.kind in {"curator", "filter", "order", "batch", "admission"}
    stage = cls(cls.Config(), policy="main", seed=0)
    json.dumps(stage.state_dict())
    assert all(isinstance(v, float) for v in stage.metrics().values())
    for field_name, field in cls.Config.model_fields.items():
        assert field.description, f"{name}.{field_name} has no docstring"
    with pytest.raises(ValidationError):
        cls.Config.model_validate({"no_such_option": 1})

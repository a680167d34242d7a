"""Post-rollout filters: dynamic sampling, length and format, on hand-made groups."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from astraflow.data.base import GroupView, zero_variance
from astraflow.data.dynamic_sampling import DynamicSamplingFilter
from astraflow.data.format_filter import FormatFilter, FormatFilterConfig
from astraflow.data.length_filter import LengthFilter, LengthFilterConfig


def group(
    rewards: list[float],
    lengths: list[int] | None = None,
    truncated: list[bool] | None = None,
    info: list[dict[str, Any]] | None = None,
) -> GroupView:
    """A finished group of one prompt."""
    n = len(rewards)
    return GroupView(
        task_id=1,
        prompt_key="p",
        policy="main",
        rewards=rewards,
        advantages=[0.0] * n,
        lengths=lengths if lengths is not None else [4] * n,
        truncated=truncated if truncated is not None else [],
        info=info if info is not None else [],
    )


def test_zero_variance_edges() -> None:
    assert zero_variance([]) and zero_variance([0.3]) and zero_variance([1.0, 1.0, 1.0])
    assert not zero_variance([1.0, 0.0]) and not zero_variance([0.5, 0.5, 0.5000001])


def test_dynamic_sampling_drops_all_equal_groups() -> None:
    f = DynamicSamplingFilter(policy="main")
    assert f.keep(group([0.0, 1.0, 1.0]))
    assert not f.keep(group([1.0, 1.0, 1.0]))
    assert not f.keep(group([0.0, 0.0]))
    assert not f.keep(group([0.7]))  # singleton: its only advantage is 0
    assert f.metrics() == {"kept": 1.0, "filtered": 3.0}
    g = DynamicSamplingFilter()
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert g.metrics() == f.metrics()


def test_length_filter_truncated_and_overlong() -> None:
    f = LengthFilter()
    assert f.keep(group([1.0, 0.0], truncated=[False, False]))
    assert not f.keep(group([1.0, 0.0], truncated=[False, True]))
    assert f.keep(group([1.0, 0.0], lengths=[900, 1000]))  # no max_length by default
    m = LengthFilter(LengthFilterConfig(max_length=100, drop_truncated=False, max_bad_fraction=0.25))
    assert m.keep(group([0.0] * 4, lengths=[10, 20, 30, 101], truncated=[True] * 4))  # 1/4 bad: not > 0.25
    assert not m.keep(group([0.0] * 4, lengths=[101, 20, 30, 101]))  # 2/4 bad
    assert m.metrics() == {"kept": 1.0, "filtered": 1.0, "truncated": 4.0, "overlong": 3.0}
    assert f.metrics()["kept"] == 2.0 and f.metrics()["filtered"] == 1.0
    assert LengthFilter().keep(group([]))
    with pytest.raises(ValidationError):
        LengthFilterConfig(max_bad_fraction=1.0)


def test_format_filter_key_missing_and_fraction() -> None:
    f = FormatFilter()
    assert f.keep(group([1.0, 0.0], info=[{"format_ok": True}, {"format_ok": 1}]))
    assert not f.keep(group([1.0, 0.0], info=[{"format_ok": True}, {"format_ok": False}]))
    assert f.keep(group([1.0, 0.0]))  # no info at all: missing counts as ok
    assert f.metrics() == {"kept": 2.0, "filtered": 1.0, "bad_format": 1.0}
    strict = FormatFilter(FormatFilterConfig(key="parsed", missing="bad", max_bad_fraction=0.5))
    assert strict.keep(group([0.0] * 4, info=[{"parsed": True}] * 2))  # 2 missing of 4: 0.5, not > 0.5
    assert not strict.keep(group([0.0] * 4, info=[{"parsed": True}, {"parsed": False}, {}, {}]))

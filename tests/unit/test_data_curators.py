"""filter_solved and curriculum curators against values worked out from their definitions."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from astraflow.data.curriculum import CurriculumConfig, CurriculumCurator
from astraflow.data.filter_solved import FilterSolvedConfig, FilterSolvedCurator


def test_filter_solved_skips_once_ewma_reaches_095() -> None:
    c = FilterSolvedCurator(policy="main")
    # From 0 with decay 0.9 and success 1 every time, s_n = 1 - 0.9**n: 0.9477 after 28, 0.9529 after 29.
    for _ in range(28):
        c.observe("p", [1.0, 1.0])
    assert c.ewma["p"] == pytest.approx(1 - 0.9**28)
    assert c.submit("p", {})
    c.observe("p", [1.0, 1.0])
    assert not c.submit("p", {})
    assert c.submit("other", {})
    assert c.metrics() == {"submitted": 2.0, "skipped": 1.0, "solved": 1.0}


def test_filter_solved_mean_and_threshold_success() -> None:
    mean = FilterSolvedCurator()
    mean.observe("p", [1.0, 0.5, 1.0, 0.0])
    assert mean.ewma["p"] == pytest.approx(0.1 * 0.625)
    thr = FilterSolvedCurator(FilterSolvedConfig(success="threshold", reward_threshold=1.0))
    thr.observe("p", [1.0, 0.5, 1.0, 0.0])
    assert thr.ewma["p"] == pytest.approx(0.1 * 0.5)
    assert thr.group_success([]) == 0.0


def test_filter_solved_initial_and_round_trip() -> None:
    c = FilterSolvedCurator(FilterSolvedConfig(initial=0.95))
    assert not c.submit("never-seen", {})  # a prior at the threshold skips unseen prompts
    c.observe("p", [0.0])
    assert c.ewma["p"] == pytest.approx(0.855)
    d = FilterSolvedCurator(FilterSolvedConfig(initial=0.95))
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert d.ewma == c.ewma and d.metrics() == c.metrics()


def test_curriculum_gates_by_difficulty_and_frontier_rises_with_success() -> None:
    c = CurriculumCurator(policy="main")  # start 0.3, full_at 0.7, decay 0.9
    assert c.submit("easy", {"difficulty": 0.2})
    assert not c.submit("mid", {"difficulty": 0.5})
    for _ in range(3):
        c.observe("easy", [1.0, 1.0])
    assert c.frontier == pytest.approx(0.3)  # moves only on a new version
    c.on_version(1)
    competence = 1 - 0.9**3
    assert c.competence == pytest.approx(competence)
    assert c.frontier == pytest.approx(0.3 + 0.7 * competence / 0.7)
    assert c.submit("mid", {"difficulty": 0.5})
    # Failures lower competence but the frontier never retreats.
    for _ in range(10):
        c.observe("mid", [0.0, 0.0])
    c.on_version(2)
    assert c.frontier == pytest.approx(0.3 + competence)
    assert c.metrics()["submitted"] == 2.0 and c.metrics()["skipped"] == 1.0


def test_curriculum_scales_levels_and_uses_observed_success_without_field() -> None:
    c = CurriculumCurator(CurriculumConfig(difficulty_min=1, difficulty_max=5, start=0.5))
    assert c.difficulty("x", {"difficulty": 3}) == pytest.approx(0.5)
    assert c.difficulty("x", {"difficulty": 9}) == 1.0
    assert c.submit("x", {"difficulty": 3}) and not c.submit("y", {"difficulty": 4})
    assert c.submit("free", {})  # unknown prompts count as easiest so they get measured
    c.observe("free", [0.0, 0.0, 1.0, 0.0])
    assert c.difficulty("free", {}) == pytest.approx(0.75)
    assert not c.submit("free", {})


def test_curriculum_never_starves() -> None:
    c = CurriculumCurator(CurriculumConfig(start=0.1))
    pool = [("a", 0.9), ("b", 0.6), ("c", 0.8)]
    first = [c.submit(k, {"difficulty": d}) for k, d in pool]
    assert first == [False, False, False] and c.frontier == pytest.approx(0.1)
    # Offering "a" again means a whole pass was skipped: the frontier opens to the easiest (0.6).
    assert not c.submit("a", {"difficulty": 0.9})
    assert c.frontier == pytest.approx(0.6)
    assert c.submit("b", {"difficulty": 0.6})


def test_curriculum_round_trip_and_config_validation() -> None:
    c = CurriculumCurator()
    c.submit("a", {"difficulty": 0.9})
    c.observe("b", [1.0])
    c.on_version(1)
    d = CurriculumCurator()
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert d.state_dict() == c.state_dict()
    assert d.submit("a", {"difficulty": 0.9}) == c.submit("a", {"difficulty": 0.9})
    with pytest.raises(ValidationError):
        CurriculumConfig(difficulty_min=2, difficulty_max=1)
    with pytest.raises(ValidationError):
        CurriculumConfig(bogus=1)  # type: ignore[call-arg]

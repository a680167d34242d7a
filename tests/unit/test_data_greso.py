"""GRESO curator: streaks, probabilities, adaptation, warm-up, property tests and exact resume."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astraflow.data.greso import GresoConfig, GresoCurator


def warm(**options: object) -> GresoCurator:
    """A curator with warm-up already over."""
    return GresoCurator(GresoConfig(warmup_groups=0, **options), policy="main", seed=7)


def test_streaks_count_consecutive_zero_variance_groups_and_their_kind() -> None:
    g = warm()
    g.observe("a", [1.0, 1.0, 1.0])
    assert g.streaks["a"] == (1, "easy")
    g.observe("a", [1.0])  # a singleton group has zero variance too
    assert g.streaks["a"] == (2, "easy")
    g.observe("a", [0.0, 0.0])
    assert g.streaks["a"] == (1, "hard")
    g.observe("a", [0.5, 0.5])  # mean 0.5 is not above 0.5: hard
    assert g.streaks["a"] == (2, "hard")
    g.observe("a", [0.0, 1.0])
    assert "a" not in g.streaks


def test_probability_is_p_to_the_streak_with_kind_floor() -> None:
    g = warm()
    g.streaks = {"e2": (2, "easy"), "e5": (5, "easy"), "h1": (1, "hard"), "h2": (2, "hard")}
    assert g.probability("e2") == pytest.approx(0.25)
    assert g.probability("e5") == pytest.approx(0.05)  # 0.5**5 = 0.03125 < floor 0.05
    assert g.probability("h1") == pytest.approx(0.5)
    assert g.probability("h2") == pytest.approx(0.30)  # 0.25 < floor 0.30
    assert g.probability("unseen") == 1.0


def test_skip_rate_matches_probability_and_counters_by_kind() -> None:
    g = warm()
    g.streaks = {"e": (2, "easy"), "h": (2, "hard")}
    n = 4000
    easy = sum(g.submit("e", {}) for _ in range(n))
    hard = sum(g.submit("h", {}) for _ in range(n))
    assert abs(easy / n - 0.25) < 0.03
    assert abs(hard / n - 0.30) < 0.03
    m = g.metrics()
    assert m["submitted"] == easy + hard
    assert m["skipped_easy"] == n - easy and m["skipped_hard"] == n - hard
    assert m["skipped"] == 2 * n - easy - hard


def test_on_version_nudges_toward_targets_from_the_window() -> None:
    g = warm()
    for i in range(2):
        g.observe(f"easy{i}", [1.0, 1.0])
    g.observe("hard0", [0.0, 0.0])
    for i in range(7):
        g.observe(f"mixed{i}", [0.0, 1.0])
    # 10 groups: easy zero-variance 0.2 > 0.083 -> p_easy down; hard 0.1 < 0.167 -> p_hard up.
    g.on_version(1)
    assert g.p["easy"] == pytest.approx(0.49) and g.p["hard"] == pytest.approx(0.51)
    g.on_version(2)  # empty window: no evidence, no change
    assert g.p["easy"] == pytest.approx(0.49) and g.p["hard"] == pytest.approx(0.51)
    assert g.metrics()["p_easy"] == pytest.approx(0.49)


def test_p_is_clamped() -> None:
    g = warm(p_init=0.99)
    for v in range(5):
        g.observe("mixed", [0.0, 1.0])
        g.on_version(v)
    assert g.p == {"easy": 0.99, "hard": 0.99}


def test_warmup_one_epoch_submits_everything_and_freezes_p() -> None:
    g = GresoCurator(policy="main", seed=1)
    keys = [f"k{i}" for i in range(20)]
    for k in keys:
        assert g.submit(k, {})
        g.observe(k, [0.0] * 4)
    g.on_version(1)
    assert not g.warm
    assert g.p == {"easy": 0.5, "hard": 0.5}  # frozen although every group was hard zero-variance
    # Second epoch: offering a prompt again ends the warm-up and skipping starts (floor 0.30).
    results = [g.submit(k, {}) for k in keys * 20]
    assert g.warm
    assert 0 < sum(results) < len(results)


def test_warmup_by_group_count() -> None:
    g = GresoCurator(GresoConfig(warmup_groups=3), seed=0)
    g.observe("a", [1.0, 1.0])
    g.observe("a", [1.0, 1.0])
    assert not g.warm and all(g.submit("a", {}) for _ in range(50))
    g.observe("a", [1.0, 1.0])
    assert g.warm and not all(g.submit("a", {}) for _ in range(50))  # p = 0.5**3 -> 0.125


groups = st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.sampled_from("abcd"), groups),
        st.tuples(st.just("submit"), st.sampled_from("abcd"), st.just([])),
        st.tuples(st.just("version"), st.just(""), st.just([])),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, p_init=st.floats(0.01, 0.99), seed=st.integers(0, 2**16))
def test_property_streak_zero_always_submitted_and_p_in_bounds(
    ops: list[tuple[str, str, list[float]]], p_init: float, seed: int
) -> None:
    g = GresoCurator(GresoConfig(warmup_groups=0, p_init=p_init, step=0.2), seed=seed)
    for op, key, rewards in ops:
        if op == "observe":
            g.observe(key, rewards)
        elif op == "submit":
            streak = g.streaks.get(key, (0, "hard"))[0]
            if not g.submit(key, {}):
                assert streak > 0
        else:
            g.on_version(0)
        assert 0.01 <= g.p["easy"] <= 0.99 and 0.01 <= g.p["hard"] <= 0.99


def test_state_dict_round_trip_continues_identically() -> None:
    a = GresoCurator(GresoConfig(warmup_groups=5), policy="main", seed=3)
    script = [(f"k{i % 6}", [float(i % 3 == 0)] * 4 if i % 2 else [0.0, 1.0]) for i in range(40)]
    for i, (key, rewards) in enumerate(script[:20]):
        a.submit(key, {})
        a.observe(key, rewards)
        if i % 4 == 3:
            a.on_version(i)
    saved = json.loads(json.dumps(a.state_dict()))
    b = GresoCurator(GresoConfig(warmup_groups=5), policy="main", seed=999)  # different seed: state wins
    b.load_state_dict(saved)
    trace_a, trace_b = [], []
    for i, (key, rewards) in enumerate(script[20:] * 5):
        for g, trace in ((a, trace_a), (b, trace_b)):
            trace.append(g.submit(key, {}))
            g.observe(key, rewards)
            if i % 4 == 3:
                g.on_version(i)
    assert trace_a == trace_b and False in trace_a
    assert a.metrics() == b.metrics()
    assert a.rng.random() == b.rng.random()


def test_same_seed_same_decisions_different_policy_differs() -> None:
    def run(policy: str) -> list[bool]:
        g = GresoCurator(GresoConfig(warmup_groups=0), policy=policy, seed=5)
        g.streaks = {"k": (1, "hard")}
        return [g.submit("k", {}) for _ in range(64)]

    assert run("x") == run("x")
    assert run("x") != run("y")

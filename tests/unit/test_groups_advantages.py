"""`groups_advantages` (every group of a message in numpy passes) gives `group_advantages`' values to
the bit, group by group, for both kinds, over random groups and the edge cases."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from astraflow.dataflow.advantages import group_advantages, groups_advantages


def _bits(xs: list[float]) -> list[bytes]:
    # struct keeps the sign of a zero and tells every NaN and inf apart, where == would not
    return [struct.pack("<d", x) for x in xs]


def _check(groups: list[list[float]], kind: str) -> None:
    flat = np.array([r for g in groups for r in g], np.float64)
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g))
    got = groups_advantages(flat, starts, kind)
    assert len(got) == len(groups)
    for g, adv in zip(groups, got, strict=True):
        assert _bits(adv) == _bits(group_advantages(g, kind)), (kind, g)
        assert all(type(a) is float for a in adv)


def _random_group(rng: random.Random) -> list[float]:
    n = rng.choice([1, 2, 3, 4, 7, 8, 16, 16, 16, 33])
    pick = rng.random()
    if pick < 0.2:
        return [float(rng.randint(0, 1)) for _ in range(n)]  # pass/fail rewards, often all equal
    if pick < 0.3:
        return [0.0] * n
    if pick < 0.35:
        return [rng.choice([0.0, -0.0]) for _ in range(n)]
    if pick < 0.5:
        scale = 10.0 ** rng.randint(-300, 300)
        return [rng.uniform(-1, 1) * scale for _ in range(n)]
    if pick < 0.6:
        return [rng.choice([-1.7e308, 1.7e308, 0.0, 5e-324]) for _ in range(n)]
    if pick < 0.7:
        v = rng.gauss(0, 1)
        return [v] * (n - 1) + [v + 1e-12]
    return [rng.gauss(0, 3) for _ in range(n)]


@pytest.mark.parametrize("kind", ["grpo", "drgrpo"])
def test_random_messages_match_group_advantages_bit_for_bit(kind: str) -> None:
    rng = random.Random(19)
    for _ in range(400):
        _check([_random_group(rng) for _ in range(rng.randint(1, 20))], kind)


@pytest.mark.parametrize("kind", ["grpo", "drgrpo"])
def test_edge_groups(kind: str) -> None:
    _check([[0.5]], kind)  # size 1
    _check([[0.0] * 16, [1.0] * 16, [0.3]], kind)  # all equal: zeros
    _check([[1.0, 0.0, 0.0, 1.0], [0.75, 0.25], [-0.0, 0.0]], kind)
    _check([[1.7e308, -1.7e308], [1.7e308, 1.7e307, -1.7e308]], kind)  # drgrpo overflows to inf
    _check([[5e-324, 0.0, 5e-324], [1e-300, -1e-300]], kind)  # subnormal scales
    assert groups_advantages(np.zeros(0), [0], kind) == []


def test_unknown_kind_refused() -> None:
    with pytest.raises(ValueError, match="unknown advantage kind"):
        groups_advantages(np.zeros(1), [0, 1], "ppo")

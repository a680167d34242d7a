"""The controller settles its heap again as members join (lifecycle._settle_again): what it keeps per
member leaves the cyclic collector's full walks once the members alive doubled."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from astraflow.roles.controller.lifecycle import RESETTLE_MIN, LoopState, _settle_again


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # this test process is not a controller's: give back what the test froze


def test_the_heap_is_settled_again_when_the_members_doubled(thawed: None) -> None:
    loop = LoopState(settled_members=RESETTLE_MIN // 2)
    kept = [{"member": i} for i in range(1000)]  # what a joined member leaves behind
    _settle_again(loop, RESETTLE_MIN - 1)  # below the floor: nothing
    assert gc.get_freeze_count() == 0
    _settle_again(loop, RESETTLE_MIN)
    frozen = gc.get_freeze_count()
    assert frozen >= len(kept) and loop.settled_members == RESETTLE_MIN
    _settle_again(loop, 2 * RESETTLE_MIN - 1)  # not doubled since: nothing more
    assert gc.get_freeze_count() == frozen
    _settle_again(loop, 2 * RESETTLE_MIN)
    assert loop.settled_members == 2 * RESETTLE_MIN


def test_a_process_that_does_not_settle_its_heap_is_left_alone(thawed: None) -> None:
    loop = LoopState()  # settled_members 0: not the controller's own process (a test, a bench)
    _settle_again(loop, 100 * RESETTLE_MIN)
    assert gc.get_freeze_count() == 0 and loop.settled_members == 0

"""The ledger's task counts (a step's metrics row asks every step) keep the done count in memory once
read: they equal a count of the store after completions, failures, a rolled-back completion and a
retention pass that retires done tasks. A real state.db."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.state import tasks
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store


def test_counts_follow_the_store_through_completions_rollbacks_and_retirement(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    ledger = Ledger(store, max_attempts=1)
    for k in range(6):
        ledger.enqueue(f"p{k}", {}, {"solver": "main"}, 1)
    assert ledger.counts() == tasks.status_counts(store) == {"queued": 6, "leased": 0, "done": 0, "failed": 0}
    leased = ledger.lease("w", 5)
    for t in leased[:3]:
        assert ledger.complete(t.id, t.epoch, "w") == "accepted"
    assert ledger.complete(leased[0].id, leased[0].epoch, "w") == "duplicate"
    assert ledger.fail(leased[3].id, leased[3].epoch, "w", "boom") == "failed"
    assert ledger.counts() == tasks.status_counts(store) == {"queued": 1, "leased": 1, "done": 3, "failed": 1}
    assert ledger._done == 3  # kept by the completions, not read again
    with pytest.raises(RuntimeError), store.write():
        ledger.complete(leased[4].id, leased[4].epoch, "w")
        raise RuntimeError("the result is refused after its task was completed")
    expected = {"queued": 1, "leased": 1, "done": 3, "failed": 1}
    assert ledger.counts() == tasks.status_counts(store) == expected
    with store.write() as c:  # trajectories of the newest task only: the older done tasks retire
        c.execute(
            "INSERT INTO trajectories (task_id, policy, prompt_key, reward, advantage, length, min_version, "
            "arrival, status) VALUES (?, 'main', 'p', 0, 0, 1, 0, 1, 'buffered')",
            (leased[4].id,),
        )
    assert tasks.retire_done(store) == 3
    assert ledger.counts() == tasks.status_counts(store) == expected
    assert Ledger(store).counts() == expected  # read afresh
    store.close()

"""The recorded steps kept by the one writer (state/batches.py `keep_steps`): the same answers as
state.db after every batch recorded or forgotten and after a rollback, and on a real Controller
driven without sockets, no statement of the batches table per message once a policy's steps are read."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from astraflow.bench import control_inproc as inproc
from astraflow.protocol import messages as m
from astraflow.state import batches
from astraflow.state.store import Store


def _agree(kept: Store, plain: Store, policies: list[str], steps: range) -> None:
    for pol in policies:
        assert batches.last_batch_step(kept, pol) == batches.last_batch_step(plain, pol)
        for s in steps:
            assert batches.batch_recorded(kept, pol, s) == batches.batch_recorded(plain, pol, s), (pol, s)


def test_kept_steps_answer_as_the_store(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    batches.keep_steps(store)
    reader = Store.open_readonly(tmp_path / "state.db")  # keeps nothing: asks state.db every time
    rng = random.Random(5)
    pols = ["a", "b"]
    recorded: set[tuple[str, int]] = set()
    _agree(store, reader, pols, range(0, 12))  # nothing recorded: read once, kept empty
    for _ in range(60):
        pol, step = rng.choice(pols), rng.randint(1, 10)
        op = rng.random()
        if op < 0.5 and (pol, step) not in recorded:
            batches.record_batch(store, pol, step, [1, 2], [False, False], 0, 0.0)
            recorded.add((pol, step))
        elif op < 0.75 and (pol, step) in recorded:
            batches.forget_batch(store, pol, step, [])
            recorded.discard((pol, step))
        else:  # recorded, then rolled back: the kept steps must not keep it
            with pytest.raises(RuntimeError), store.write():
                if (pol, step) not in recorded:
                    batches.record_batch(store, pol, step, [3], [False], 0, 0.0)
                else:
                    batches.forget_batch(store, pol, step, [])
                assert batches.batch_recorded(store, pol, step) == ((pol, step) not in recorded)
                raise RuntimeError("handler failed")
        _agree(store, reader, pols, range(0, 12))
    assert batches.last_batch_step(store, "a") == max((s for p, s in recorded if p == "a"), default=0)
    reader.close()
    store.close()


def test_a_controller_reads_the_batches_table_once_a_policy(tmp_path: Path) -> None:
    d = inproc._Driver(tmp_path)
    seen: list[str] = []
    d.ctl.store.conn.set_trace_callback(seen.append)
    inproc.join(d)
    rng = random.Random(0)
    inproc.run_steps(d, 1, 1, rng, 3)
    seen.clear()
    inproc.run_steps(d, 2, 4, rng, 3)
    questions = [q for q in seen if "FROM batches WHERE policy" in q and "traj_ids" not in q]
    assert not questions, questions[:3]  # steps taken and steps recorded come from memory
    assert sum(q.startswith("INSERT INTO batches") for q in seen) == 4
    # the kept steps are what state.db holds
    reader = Store.open_readonly(tmp_path / "state.db")
    _agree(d.ctl.store, reader, [inproc.POLICY], range(0, 8))
    assert isinstance(
        d.send(inproc.TRAINER, m.BatchRequest(policy=inproc.POLICY, step=9, wait_s=0.0))[0], m.Error
    )
    reader.close()
    d.ctl.store.close()

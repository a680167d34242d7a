"""A new batch is built from the TrainSamples the buffer kept when it stored them (dataflow/buffer.py
FRESH_TOKENS): they encode to the very bytes the store reads back, and after a rolled-back insert
(whose ids the next insert reuses) nothing kept from it is served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.dataflow import fresh as fresh_mod
from astraflow.dataflow.buffer import Buffer
from astraflow.protocol.codec import encode
from astraflow.protocol.messages import BatchReply, SamplingParams, Sequence
from astraflow.protocol.sample_columns import pack
from astraflow.state.store import Store


def _seq(first: int, reward: float, n: int = 4) -> Sequence:
    return Sequence(
        policy="main",
        tokens=[first] + [7] * n,
        loss_mask=[0] + [1] * n,
        logprobs=[0.0] + [-0.25 * (k + 1) for k in range(n)],
        versions=[-1] + [0] * n,
        reward=reward,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5),
    )


def _reply(samples: list) -> bytes:
    return encode(BatchReply(policy="main", step=1, columns=pack(samples), ready=True))


def test_kept_samples_are_what_the_store_reads_back(tmp_path: Path) -> None:
    buf = Buffer(Store.open(tmp_path / "s.db"))
    ids = buf.insert(1, "k1", [_seq(1, 1.0), _seq(2, 0.0)], [0.5, -0.5])
    assert set(buf._fresh) == set(ids)
    batch = buf.next_batch("main", 1, batch_size=2, max_staleness=0, version=0)
    assert batch is not None and not buf._fresh  # consumed: taken out of memory
    from_store = buf.samples(ids, [False, False])
    assert _reply(batch.samples) == _reply(from_store)
    again = buf.recorded("main", 1)
    assert again is not None and _reply(again.samples) == _reply(batch.samples)


def test_a_rolled_back_insert_leaves_nothing_kept(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    buf = Buffer(store)
    with pytest.raises(RuntimeError), store.write():
        buf.insert(1, "k1", [_seq(1, 1.0), _seq(2, 0.0)], [0.5, -0.5])
        raise RuntimeError("the result is refused after its rows were written")
    assert not buf._fresh
    ids = buf.insert(2, "k2", [_seq(3, 0.0), _seq(4, 1.0)], [-0.5, 0.5])
    batch = buf.next_batch("main", 1, batch_size=2, max_staleness=0, version=0)
    assert batch is not None and [s.traj_id for s in batch.samples] == ids
    assert [s.token_list()[0] for s in batch.samples] == [3, 4]


def test_beyond_the_budget_the_oldest_groups_are_read_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fresh_mod, "FRESH_TOKENS", 12)  # one group of two 5-token sequences fits, not two
    buf = Buffer(Store.open(tmp_path / "s.db"))
    a = buf.insert(1, "k1", [_seq(1, 1.0), _seq(2, 0.0)], [0.5, -0.5])
    b = buf.insert(2, "k2", [_seq(3, 1.0), _seq(4, 0.0)], [0.5, -0.5])
    assert list(buf._fresh) == b and buf._fresh.tokens == 10
    batch = buf.next_batch("main", 1, batch_size=4, max_staleness=0, version=0)
    assert batch is not None and not buf._fresh and buf._fresh.tokens == 0
    assert _reply(batch.samples) == _reply(buf.samples(a + b, [False] * 4))


def test_a_batch_of_kept_and_read_sequences_is_cut_where_each_came_from(tmp_path: Path) -> None:
    """Kept groups served in part (a group split across two steps), expired ones, sequences read back
    from the store and replayed ones mix in one batch: every sample is the store's bytes."""
    store = Store.open(tmp_path / "s.db")
    buf = Buffer(store)
    a = buf.insert(1, "k1", [_seq(1, 1.0), _seq(2, 0.0), _seq(3, 1.0)], [0.5, -0.5, 0.5])
    buf._fresh.forget()  # as after a restart: read back from the store
    b = buf.insert(2, "k2", [_seq(4, 0.0, 2), _seq(5, 1.0, 6), _seq(6, 1.0, 1)], [-0.5, 0.5, 0.0])
    first = buf.next_batch("main", 1, batch_size=4, max_staleness=0, version=0)
    assert first is not None and [s.traj_id for s in first.samples] == a + b[:1]
    assert list(buf._fresh) == b[1:]  # the rest of the split group stays kept
    assert _reply(first.samples) == _reply(buf.samples(a + b[:1], [False] * 4))
    second = buf.next_batch("main", 2, batch_size=2, max_staleness=1, version=1)
    assert second is not None and [s.traj_id for s in second.samples] == b[1:] and not buf._fresh
    assert _reply(second.samples) == _reply(buf.samples(b[1:], [False] * 2))
    mixed = buf.columns([b[2], a[0], b[1], a[1]], [False, True, False, True])
    from astraflow.protocol.sample_columns import cut

    got = cut(mixed)
    assert [(s.traj_id, s.replay) for s in got] == [(b[2], False), (a[0], True), (b[1], False), (a[1], True)]
    assert [s.token_list()[0] for s in got] == [6, 1, 5, 2] and [s.length for s in got] == [2, 5, 7, 5]


def test_a_step_metrics_rows_kept_when_its_batch_was_taken_are_what_the_store_reads(tmp_path: Path) -> None:
    from astraflow.state import trajectories

    store = Store.open(tmp_path / "s.db")
    buf = Buffer(store)
    b = buf.insert(2, "k2", [_seq(3, 0.0), _seq(4, 1.0)], [-0.5, 0.5])
    a = buf.insert(1, "k1", [_seq(1, 1.0), _seq(2, 0.0)], [0.5, -0.5])
    batch = buf.next_batch("main", 1, batch_size=4, max_staleness=0, version=0)
    assert batch is not None and [s.traj_id for s in batch.samples] == a + b  # task order, not id order
    from_store = trajectories.reward_rows(store, a + b)

    def rows(got: tuple[Any, ...]) -> list[tuple[float, int, int]]:
        assert [x.dtype for x in got] == [np.float64, np.int64, np.int64]
        return list(zip(*(x.tolist() for x in got), strict=True))

    assert rows(buf.taken("main", 1, a + b)) == from_store and from_store[0][2] == 2  # id order
    assert not buf._taken  # handed out once; a second ask (or a restarted controller) reads the store
    assert rows(Buffer(store).taken("main", 1, a + b)) == from_store


def test_a_step_rows_batch_figures_are_the_per_sequence_sums() -> None:
    from astraflow.roles.controller.metrics_row import batch_figures

    rng = np.random.default_rng(3)
    for n in (1, 7, 4096):
        rewards = rng.normal(size=n) * 1e3  # sums whose float rounding depends on their order
        oldest = rng.integers(-1, 9, size=n)
        ref = 9
        stale = [ref - int(v) for v in oldest]
        assert batch_figures(ref, rewards, oldest) == {
            "reward_mean": sum(float(r) for r in rewards) / n,
            "staleness_mean": sum(stale) / n,
            "staleness_max": float(max(stale)),
        }
    none = np.zeros(0)
    assert batch_figures(3, none, none.astype(np.int64)) == dict.fromkeys(
        ("reward_mean", "staleness_mean", "staleness_max"), 0.0
    )


def test_the_buffered_items_kept_in_memory_are_what_the_store_holds(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    buf = Buffer(store)
    buf.insert(1, "k1", [_seq(1, 1.0), _seq(2, 0.0)], [0.5, -0.5])
    assert buf.next_batch("main", 1, batch_size=4, max_staleness=0, version=0) is None  # reads the store
    assert "main" in buf._items
    with pytest.raises(RuntimeError), store.write():  # a rolled-back insert leaves nothing behind
        buf.insert(9, "k9", [_seq(9, 1.0)], [0.0])
        raise RuntimeError("refused after its rows were written")
    buf.insert(2, "k2", [_seq(3, 0.0), _seq(4, 1.0)], [-0.5, 0.5])
    buf.insert(3, "k3", [_seq(5, 0.0), _seq(6, 1.0)], [-0.5, 0.5])
    batch = buf.next_batch("main", 1, batch_size=4, max_staleness=0, version=0)
    assert batch is not None and len(buf._buffered("main")) == 2
    buf.insert(4, "k4", [_seq(7, 0.0), _seq(8, 1.0)], [-0.5, 0.5])
    assert buf.next_batch("main", 2, batch_size=4, max_staleness=0, version=2) is None  # all expired
    buf.insert(5, "k5", [_seq(10, 0.0)], [0.0])
    # a restarted controller reads the same
    assert buf._buffered("main").items() == Buffer(store)._buffered("main").items()
    assert [it.task_id for it in buf._buffered("main").items()] == [5]


def test_taking_runs_of_a_kept_group_around_sequences_taken_before() -> None:
    """A run of consecutive ids whose middle was taken before (expired, or consumed and now replayed)
    comes back as the kept slices around it and the taken id itself, to be read from the store."""
    from astraflow.protocol.messages import PackedSequence

    kept = fresh_mod.FreshSamples()
    kept.remember([5, 6, 7, 8], [PackedSequence.of(_seq(k, 0.0)) for k in range(4)], [0.0] * 4)
    assert kept.tokens == 20
    (one,) = kept.take([6])
    block = one[0]  # type: ignore[index]
    assert one == (block, 1, 2)
    assert kept.take([4, 5, 6, 7]) == [4, (block, 0, 1), 6, (block, 2, 3)]
    assert list(kept) == [8] and kept.tokens == 20  # the group's arrays stay while a sequence is kept
    assert kept.take([8, 9]) == [(block, 3, 4), 9] and not list(kept) and kept.tokens == 0

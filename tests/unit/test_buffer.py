"""Buffer and batches: staleness drop, exact resume, single consumption, EDF vs FIFO, whole groups, replay."""

from __future__ import annotations

from pathlib import Path

from astraflow.data.order import EdfOrder, FifoOrder
from astraflow.dataflow.buffer import Buffer, min_version
from astraflow.protocol.messages import SamplingParams, Sequence
from astraflow.state.store import Store


def _seq(version: int, reward: float = 0.0, n: int = 3) -> Sequence:
    return Sequence(
        policy="main",
        tokens=[1] * (n + 2),
        loss_mask=[0, 0] + [1] * n,
        logprobs=[0.0, 0.0] + [-0.5] * n,
        versions=[-1, -1] + [version] * n,
        reward=reward,
        sampling=SamplingParams(),
    )


def _group(buf: Buffer, task_id: int, version: int, size: int = 2) -> list[int]:
    return buf.insert(task_id, f"k{task_id}", [_seq(version, float(i)) for i in range(size)], [0.0] * size)


def test_min_version_ignores_prompt_tokens() -> None:
    s = Sequence(
        policy="p",
        tokens=[1, 2, 3, 4],
        loss_mask=[0, 1, 0, 1],
        logprobs=[0.0] * 4,
        versions=[-1, 5, -1, 3],
        sampling=SamplingParams(),
    )
    assert min_version(s) == 3


def test_roundtrip_and_counts(tmp_path: Path) -> None:
    buf = Buffer(Store.open(tmp_path / "s.db"))
    ids = _group(buf, 1, 0)
    batch = buf.next_batch("main", 1, batch_size=2, max_staleness=0, version=0)
    assert batch is not None and [s.traj_id for s in batch.samples] == ids
    s = batch.samples[0]
    assert (
        s.token_list() == [1] * 5
        and s.mask_list() == [0, 0, 1, 1, 1]
        and s.logprob_list()[-1] == -0.5
        and s.version_list()[-1] == 0
    )
    # stored and served as the packed arrays the result carried: int32 and float32 little-endian
    assert s.tokens == b"\x01\x00\x00\x00" * 5 and s.loss_mask == b"\x00\x00\x01\x01\x01"
    assert s.logprobs[-4:] == b"\x00\x00\x00\xbf"
    assert buf.counts("main") == {"buffered": 0, "consumed": 2, "expired": 0, "dropped": 0}


def test_stale_trajectories_expire_not_train(tmp_path: Path) -> None:
    buf = Buffer(Store.open(tmp_path / "s.db"))
    _group(buf, 1, 0)  # version 0: too old at version 3 with S=1
    fresh = _group(buf, 2, 2)
    batch = buf.next_batch("main", 4, batch_size=2, max_staleness=1, version=3)
    assert batch is not None and [s.traj_id for s in batch.samples] == fresh
    assert batch.expired == 2 and batch.staleness == [1, 1]
    assert buf.counts("main")["expired"] == 2
    # the step trains on at least the previous step's weights even if that version is not published yet
    _group(buf, 3, 3)
    assert buf.next_batch("main", 6, batch_size=2, max_staleness=1, version=3) is None
    assert buf.counts("main")["expired"] == 4


def test_exact_resume_and_no_double_consumption(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    buf = Buffer(store, order=lambda _p: FifoOrder())
    for t in range(1, 5):
        _group(buf, t, 0)
    b1 = buf.next_batch("main", 1, 4, 5, 0)
    b2 = buf.next_batch("main", 2, 4, 5, 1)
    assert b1 is not None and b2 is not None
    ids1, ids2 = [s.traj_id for s in b1.samples], [s.traj_id for s in b2.samples]
    assert not set(ids1) & set(ids2)
    assert buf.next_batch("main", 3, 4, 5, 2) is None  # nothing left: no trajectory trains twice
    _group(buf, 9, 2)
    _group(buf, 10, 2)
    store.close()
    # a restarted controller and trainer ask again for step 1 and 2: same trajectories, same order
    buf2 = Buffer(Store.open(tmp_path / "s.db"), order=lambda _p: EdfOrder())
    again = buf2.next_batch("main", 1, 4, 5, 2)
    assert again is not None and not again.new and [s.traj_id for s in again.samples] == ids1
    assert [s.traj_id for s in buf2.next_batch("main", 2, 4, 5, 2).samples] == ids2
    assert buf2.counts("main")["consumed"] == 8 and buf2.counts("main")["buffered"] == 4


def test_edf_serves_oldest_version_first_fifo_arrival(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    orders = {"main": FifoOrder()}
    buf = Buffer(store, order=lambda p: orders[p])
    newer = _group(buf, 1, 5)
    older = _group(buf, 2, 4)
    fifo = buf.next_batch("main", 6, 2, 3, 5)
    assert [s.traj_id for s in fifo.samples] == newer
    store2 = Store.open(tmp_path / "t.db")
    buf2 = Buffer(store2, order=lambda _p: EdfOrder())
    newer = _group(buf2, 1, 5)
    older = _group(buf2, 2, 4)
    edf = buf2.next_batch("main", 6, 2, 3, 5)
    assert [s.traj_id for s in edf.samples] == older
    assert buf2.counts("main")["buffered"] == len(newer)


def test_prefers_whole_groups(tmp_path: Path) -> None:
    buf = Buffer(Store.open(tmp_path / "s.db"), order=lambda _p: FifoOrder())
    a = _group(buf, 1, 0, size=2)
    b = _group(buf, 2, 0, size=3)
    c = _group(buf, 3, 0, size=2)
    batch = buf.next_batch("main", 1, 4, 2, 0)
    assert [s.traj_id for s in batch.samples] == a + c  # b would have been split: skipped for c
    d = _group(buf, 4, 0, size=3)
    batch2 = buf.next_batch("main", 2, 4, 2, 0)
    assert [s.traj_id for s in batch2.samples] == b + d[:1]  # no whole fit left: fill in order


def test_replay_from_most_recent_consumed(tmp_path: Path) -> None:
    buf = Buffer(
        Store.open(tmp_path / "s.db"), order=lambda _p: FifoOrder(), replay_count=lambda _p, n: n // 2
    )
    first = _group(buf, 1, 0, size=4)
    b1 = buf.next_batch("main", 1, 4, 0, 0)  # nothing consumed yet: all fresh
    assert [s.traj_id for s in b1.samples] == first and not any(s.replay for s in b1.samples)
    second = _group(buf, 2, 1, size=2)
    b2 = buf.next_batch("main", 2, 4, 0, 1)
    assert [s.traj_id for s in b2.samples][:2] == second
    assert [s.replay for s in b2.samples] == [False, False, True, True]
    assert set(s.traj_id for s in b2.samples[2:]) <= set(
        first
    )  # replay is exempt from staleness (version 0 at 1, S=0)
    again = buf.next_batch("main", 2, 4, 0, 1)
    assert [(s.traj_id, s.replay) for s in again.samples] == [(s.traj_id, s.replay) for s in b2.samples]


def test_batch_is_served_in_task_order_whatever_the_arrival(tmp_path: Path) -> None:
    """The same groups arriving in another order give the same batch, row for row (the trainer's sums,
    and so a seeded sync run, do not depend on which result came first)."""
    served = []
    for name, tasks in (("a", [3, 1, 2]), ("b", [2, 3, 1])):
        buf = Buffer(Store.open(tmp_path / f"{name}.db"), order=lambda _p: EdfOrder())
        ids = {t: _group(buf, t, 0, size=2) for t in tasks}
        batch = buf.next_batch("main", 1, 6, 1, 0)
        assert batch is not None
        by_id = {i: (t, j) for t, group in ids.items() for j, i in enumerate(group)}
        served.append([by_id[s.traj_id] for s in batch.samples])
    assert served[0] == served[1] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]


def test_a_group_stores_each_sequence_s_trained_length_and_oldest_version(tmp_path: Path) -> None:
    """min_versions works on the group's packed arrays at once: each row gets its own sequence's values,
    including one that generated nothing (oldest version present) and one with no version at all (-1)."""
    store = Store.open(tmp_path / "s.db")
    masks_versions = [
        ([0, 1, 1, 0, 1], [-1, 7, 4, -1, 9]),
        ([0, 0], [-1, 2]),
        ([0, 0, 0], [-1, -1, -1]),
        ([1, 1, 1, 1, 1, 1, 1], [3, 3, 2, 8, 8, 8, 8]),
        ([1, 0, 1], [-1, 5, 6]),  # an unversioned generated token is skipped
    ]
    seqs = [
        Sequence(
            policy="main",
            tokens=[1] * len(mask),
            loss_mask=mask,
            logprobs=[0.0] * len(mask),
            versions=versions,
            sampling=SamplingParams(),
        )
        for mask, versions in masks_versions
    ]
    ids = Buffer(store).insert(1, "k1", seqs, [0.0] * len(seqs))
    rows = store.query(
        f"SELECT id, length, min_version FROM trajectories WHERE id IN ({','.join(map(str, ids))})"
    )
    got = {r["id"]: (r["length"], r["min_version"]) for r in rows}
    assert [got[i] for i in ids] == [(3, 4), (0, 2), (0, -1), (7, 2), (2, 6)]
    assert [min_version(s) for s in seqs] == [4, 2, -1, 2, 6]

"""What a result may claim (dataflow/limits.py), advantages that never overflow, batches served in parts
that each fit a message, and a store an older version poisoned with NULL (NaN) rows: driven through
Controller.dispatch and the pipeline on a real state.db (no sockets; the live attacks are in
tests/security/test_poisoned_results_live.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.dataflow.advantages import group_advantages, nonfinite_advantage
from astraflow.dataflow.batch_parts import part_bounds
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.limits import Limits, RefusedResult, policy_max_seq_len, seq_bytes
from astraflow.dataflow.pipeline import Pipeline
from astraflow.protocol import messages as m
from astraflow.protocol.codec import encode
from astraflow.roles.controller import Controller
from astraflow.state.store import Store


def _naive(rewards: list[float]) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + 1e-5) for r in rewards]


def test_advantages_of_huge_rewards_are_finite_and_equal_the_plain_formula_elsewhere() -> None:
    assert group_advantages([1.7e307] * 16) == [0.0] * 16  # the plain mean is inf, its advantages NaN
    adv = group_advantages([1.7e307] * 15 + [1e308])  # the plain square raises OverflowError
    assert all(map(math.isfinite, adv)) and adv[-1] > 0 > adv[0]
    assert group_advantages([1e308, -1e308, 0.0], "drgrpo") == [1e308, -1e308, 0.0]
    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.75, 0.25], [3.0, -2.0, 0.5, 0.5, 7.0], [1e-9, 2e-9, 0.0]):
        assert group_advantages(rewards) == pytest.approx(_naive(rewards), rel=1e-12, abs=1e-12)
    # r - mean beyond the float range: not finite, and said so (refused at ingest)
    over = group_advantages([1.7e308, -1.7e308, -1.7e308], "drgrpo")
    assert "not finite" in nonfinite_advantage(over) and nonfinite_advantage([0.5, -0.5]) == ""


def test_part_bounds_cover_the_batch_in_order_within_the_budget() -> None:
    sizes = [100, 900, 50, 700, 700, 10, 3000, 20]
    budget = 1500
    bounds = part_bounds(sizes, budget)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    for a, b in bounds:
        assert b > a
        assert b - a == 1 or sum(s + 256 for s in sizes[a:b]) <= budget
    assert (6, 7) in bounds  # a sample over the budget travels alone
    assert part_bounds([10, 10], 1 << 20) == [(0, 2)] and part_bounds([], 100) == [(0, 0)]


def test_the_sequence_bound_is_the_engine_s_or_the_model_s_unless_the_policy_sets_one(
    tiny_model: Path, tmp_path: Path
) -> None:
    # the tiny model's max_position_embeddings is 512, the torch engine's default max_seq_len 2048
    assert policy_max_seq_len(PolicyConfig(model=str(tiny_model))) == 2048
    assert policy_max_seq_len(PolicyConfig(model=str(tiny_model), engine_options={"max_seq_len": 300})) == 512
    longer = PolicyConfig(model=str(tiny_model), engine_options={"max_seq_len": 5000})
    assert policy_max_seq_len(longer) == 5000
    assert policy_max_seq_len(PolicyConfig(model=str(tmp_path), engine_options={"max_seq_len": 300})) == 300
    assert policy_max_seq_len(PolicyConfig(model=str(tiny_model), max_seq_len=99)) == 99


def _recipe(model: Path, part_bytes: int = 4096, **policy: object) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "limits", "steps": 3},
            "policy": [{"name": "main", "model": str(model), "group_size": 4, "batch_prompts": 2, **policy}],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"slots": 8},
            "controller": {"batch_part_bytes": part_bytes},
        }
    )


def _seq(n: int, reward: float, logprob: float = -0.5) -> m.Sequence:
    return m.Sequence(
        policy="main",
        tokens=[4 + i % 15 for i in range(n)],
        loss_mask=[0] + [1] * (n - 1),
        logprobs=[0.0] + [logprob] * (n - 1),
        versions=[-1] + [0] * (n - 1),
        reward=reward,
        sampling=m.SamplingParams(),
    )


def _controller(model: Path, tmp_path: Path, part_bytes: int = 4096) -> Controller:
    c = Controller(_recipe(model, part_bytes), tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    for ident, role in (("trainer-main", "trainer"), ("w", "raas")):
        hello = m.Hello(
            member_id=ident, role=role, protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
        )
        assert isinstance(c.handle(ident.encode(), hello), m.Welcome)
    return c


def test_limits_name_what_a_sequence_breaks(tiny_model: Path) -> None:
    lim = Limits.of(_recipe(tiny_model, max_abs_reward=10.0))
    assert lim.sequence(_seq(8, 10.0)) == ""
    assert "max_seq_len of policy 'main' (2048;" in lim.sequence(_seq(2049, 0.0))
    assert "max_abs_reward" in lim.sequence(_seq(8, -10.5))
    assert "below -1000" in lim.sequence(_seq(8, 0.0, logprob=-5000.0))
    small = Limits(max_seq_len={"main": None}, max_abs_reward={"main": 1.0}, part_bytes=seq_bytes(100))
    assert small.sequence(_seq(100, 0.0)) == "" and "batch part" in small.sequence(_seq(101, 0.0))


def test_a_batch_larger_than_a_part_is_served_in_parts_that_each_fit(
    tiny_model: Path, tmp_path: Path
) -> None:
    c = _controller(tiny_model, tmp_path)
    grant = c.handle(b"w", m.TaskRequest(n=2, loaded={"main": 0}))
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 2
    for t in grant.tasks:
        eps = [m.Episode(sequences=[_seq(40 + 10 * i, float(i % 2))]) for i in range(4)]
        ack = c.handle(b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=eps))
        assert isinstance(ack, m.ResultAck) and ack.status == "accepted", ack
    first = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=1))
    assert isinstance(first, m.BatchReply) and first.ready and first.parts > 1, first
    got = list(first.samples)
    for part in range(1, first.parts):
        reply = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=1, part=part))
        assert isinstance(reply, m.BatchReply) and reply.ready and reply.part == part
        assert len(encode(reply)) <= 4096 + 512 or len(reply.samples) == 1
        got += reply.samples
    rec = c.buffer.recorded_ids("main", 1)
    assert rec is not None and [s.traj_id for s in got] == rec[0] and len(got) == 8
    again = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=1))
    assert isinstance(again, m.BatchReply) and again.samples == first.samples  # the same split every time
    beyond = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=1, part=first.parts))
    assert isinstance(beyond, m.Error) and beyond.code == "bad_request"
    ahead = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=2, part=1))
    assert isinstance(ahead, m.Error), "a part of a batch that is not recorded"


def test_a_non_finite_advantage_is_refused_before_anything_changes(tiny_model: Path, tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    rec = _recipe(tiny_model, advantage="drgrpo")
    pipe = Pipeline(rec.policy, store, seed=rec.run.seed)
    buffer = Buffer(store)
    eps = [m.Episode(sequences=[_seq(5, r)], info={"x": 1.0}) for r in (1.7e308, -1.7e308, -1.7e308, 0.0)]
    with pytest.raises(RefusedResult, match="advantages are not finite"):
        pipe.ingest(buffer, 1, "k", eps)
    assert store.scalar("SELECT COUNT(*) FROM trajectories") == 0 and not pipe.info
    assert pipe.policies["main"].counters["groups_kept"] == 0


def test_a_store_poisoned_with_nan_rows_does_not_wedge_the_run(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path, part_bytes=1 << 20)
    grant = c.handle(b"w", m.TaskRequest(n=3, loaded={"main": 0}))
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 3
    for t in grant.tasks:
        eps = [m.Episode(sequences=[_seq(6, float(i % 2))]) for i in range(4)]
        assert (
            c.handle(b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=eps)).status == "accepted"
        )  # type: ignore[attr-defined]
    # what an older version stored for NaN advantages (the bound came later): NULL, in the first group
    poisoned = [r[0] for r in c.store.query("SELECT id FROM trajectories ORDER BY id LIMIT 4")]
    with c.store.write() as db:
        db.executemany(
            "UPDATE trajectories SET advantage = ? WHERE id = ?", [(math.nan, i) for i in poisoned]
        )
        # and a batch recorded before with one of them in it (never deliverable)
        db.execute(
            "INSERT INTO batches (policy, step, traj_ids, replay, version, created) VALUES ('main', 1, ?, ?, 0, 0)",
            (json.dumps(poisoned[:1]), json.dumps([False])),
        )
    assert c.store.scalar("SELECT COUNT(*) FROM trajectories WHERE advantage IS NULL") == 4
    with pytest.raises(TypeError):
        c.buffer.recorded("main", 1)  # what every BatchRequest of step 1 met, restart after restart
    c.store.close()

    again = Controller(_recipe(tiny_model, 1 << 20), tmp_path, Store.open(tmp_path / "state.db"))
    again.start()
    events = [e for e in again.store.events() if e["kind"] == "poisoned_dropped"]
    assert (
        len(events) == 1 and "4 trajectories" in events[0]["detail"] and "main step 1" in events[0]["detail"]
    )
    for ident, role in (("trainer-main", "trainer"), ("w", "raas")):
        hello = m.Hello(
            member_id=ident, role=role, protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
        )
        again.handle(ident.encode(), hello)
    batch = again.handle(b"trainer-main", m.BatchRequest(policy="main", step=1))
    assert isinstance(batch, m.BatchReply) and batch.ready and len(batch.samples) == 8, batch
    assert not {s.traj_id for s in batch.samples} & set(poisoned)
    assert all(math.isfinite(s.advantage) for s in batch.samples)

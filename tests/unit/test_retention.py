"""Retention (controller.retention, state/archive.py), driven through Controller.dispatch on a real
state.db (no sockets) for many steps: state.db keeps only the last steps' trajectories, the rest are
in Parquet files that export, the sample browser, status and a re-served batch read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.state.batches import decode_ids
from astraflow.state.store import Store

pytest.importorskip("pyarrow")

GROUP, PROMPTS, KEEP, EVERY, STEPS = 4, 2, 3, 2, 24
BATCH = GROUP * PROMPTS


def _recipe(model: Path, action: str) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "retention", "steps": 100, "seed": 0},
            "policy": [
                {
                    "name": "main",
                    "model": str(model),
                    "group_size": GROUP,
                    "batch_prompts": PROMPTS,
                    "max_staleness": 1,
                    "checkpoint_every": KEEP,
                }
            ],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"slots": 8},
            "controller": {"retention": {"keep_steps": KEEP, "every_steps": EVERY, "action": action}},
        }
    )


def _start(recipe: Recipe, run_dir: Path) -> Controller:
    c = Controller(recipe, run_dir, Store.open(run_dir / "state.db"))
    c.start()
    for ident, role in (("trainer-main", "trainer"), ("w", "raas")):
        hello = m.Hello(
            member_id=ident, role=role, protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
        )
        assert isinstance(c.dispatch(ident.encode(), hello)[0][1], m.Welcome)
    return c


def _episodes(task_id: int, version: int) -> list[m.Episode]:
    seq = m.Sequence(
        policy="main",
        tokens=[5, 6, 7, 8],
        loss_mask=[0, 1, 1, 1],
        logprobs=[0.0, -0.5, -0.25, -0.125],
        versions=[-1, version, version, version],
        reward=0.0,
        sampling=m.SamplingParams(),
    )
    return [m.Episode(sequences=[_with_reward(seq, float((task_id + i) % 2))]) for i in range(GROUP)]


def _with_reward(seq: m.Sequence, reward: float) -> m.Sequence:
    import msgspec

    return msgspec.structs.replace(seq, reward=reward)


def _step(c: Controller, step: int) -> m.BatchReply:
    """Results until the step's batch is ready, the batch, then the version."""
    for _ in range(20):
        reply = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=step))
        assert isinstance(reply, m.BatchReply), reply
        if reply.ready:
            break
        grant = c.handle(b"w", m.TaskRequest(n=8, loaded={"main": step - 1}))
        assert isinstance(grant, m.TaskGrant) and grant.tasks, grant
        results = [
            m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t.task_id, step - 1))
            for t in grant.tasks
        ]
        acks = c.handle(b"w", m.TaskResults.of(results))
        assert isinstance(acks, m.ResultsAck) and {a.status for a in acks.acks} == {"accepted"}, acks
    assert reply.ready and len(reply.samples) == BATCH
    ack = c.handle(
        b"trainer-main", m.VersionPublished(policy="main", version=step, step=step, weights_addr="")
    )
    assert isinstance(ack, m.Ack) and ack.detail == "recorded"
    return reply


def _rows(c: Controller) -> int:
    return int(c.store.scalar("SELECT COUNT(*) FROM trajectories"))


def test_state_db_keeps_the_last_steps_and_the_archive_the_rest(tiny_model: Path, tmp_path: Path) -> None:
    from astraflow.metrics.export import trajectory_rows
    from astraflow.state.status import build_status
    from astraflow.state.views import recent_samples, tasks_done_by_member

    c = _start(_recipe(tiny_model, "archive"), tmp_path)
    served: dict[int, list[Any]] = {}
    peak = 0
    for step in range(1, STEPS + 1):
        served[step] = [(s.traj_id, s.tokens, s.advantage) for s in _step(c, step).samples]
        peak = max(peak, _rows(c))
    # bounded: the kept steps, the steps since the last pass, and what admission produced ahead
    assert peak <= (KEEP + EVERY + 3) * BATCH, peak
    files = sorted((tmp_path / "archive").glob("*.parquet"))
    assert files and not list((tmp_path / "archive").glob("*.tmp"))
    generated = c.buffer.generated("main")
    # export reads both: every trajectory once, by id
    exported = list(trajectory_rows(tmp_path, text=False))
    ids = [r["id"] for r in exported]
    assert ids == sorted(set(ids)) and len(ids) == generated > _rows(c)
    # status counts what left state.db
    counts = build_status(c.store)["buffers"]["main"]
    assert sum(counts.values()) == generated and counts["consumed"] == STEPS * BATCH
    # the sample browser fills from the archive once state.db has fewer than asked
    assert len(recent_samples(c.store, "main", limit=generated)) == generated
    # done tasks whose results all left go too, and every count of them stays
    done_in_db = int(c.store.scalar("SELECT COUNT(*) FROM tasks WHERE status = 'done'"))
    tasks_doc = build_status(c.store)["tasks"]
    assert 0 < done_in_db < tasks_doc["done"] == c.ledger.counts()["done"]
    assert done_in_db <= (KEEP + EVERY + 3) * PROMPTS, done_in_db
    assert tasks_doc["done"] >= STEPS * PROMPTS
    assert tasks_done_by_member(c.store) == {"w": tasks_doc["done"]}
    oldest_kept = c.store.scalar("SELECT MIN(task_id) FROM trajectories")
    assert not c.store.query("SELECT id FROM tasks WHERE status = 'done' AND id < ?", (oldest_kept,))
    # a batch row holds runs of ids, not every id
    row = c.store.query("SELECT traj_ids, replay FROM batches WHERE step = 2")[0]
    runs = json.loads(row["traj_ids"])
    assert len(runs) <= PROMPTS and all(isinstance(r, list) for r in runs) and row["replay"] == "[]"
    assert decode_ids(row["traj_ids"]) == [i for i, _, _ in served[2]]
    # a recorded batch whose trajectories were archived is served again the same (a trainer's resume)
    again = c.handle(b"trainer-main", m.BatchRequest(policy="main", step=2))
    assert isinstance(again, m.BatchReply) and again.ready
    assert not c.store.query("SELECT id FROM trajectories WHERE consumed_step = 2")
    assert [(s.traj_id, s.tokens, s.advantage) for s in again.samples] == served[2]
    # a restarted controller goes on from the same state
    c.store.close()
    c = _start(_recipe(tiny_model, "archive"), tmp_path)
    _step(c, STEPS + 1)
    assert _rows(c) <= (KEEP + EVERY + 3) * BATCH


def test_drop_deletes_and_still_counts(tiny_model: Path, tmp_path: Path) -> None:
    from astraflow.state.status import build_status

    c = _start(_recipe(tiny_model, "drop"), tmp_path)
    for step in range(1, 11):
        _step(c, step)
    assert not (tmp_path / "archive").exists()
    assert _rows(c) < c.buffer.generated("main")
    counts = build_status(c.store)["buffers"]["main"]
    assert counts["consumed"] == 10 * BATCH


def test_drop_needs_keep_steps_of_a_checkpoint_interval(tiny_model: Path) -> None:
    doc = _recipe(tiny_model, "drop").model_dump(mode="json")
    doc["policy"][0]["checkpoint_every"] = KEEP + 1
    with pytest.raises(ValueError, match="checkpoint_every"):
        Recipe.model_validate(doc)

"""`kill -9` of the controller with GRESO and replay stages: the data-stage state on disk matches the
events it counts at the moment of the kill (it commits with them), a restart with a changed recipe is
refused with a diff, and an allowed change resumes the run to its end with nothing trained twice."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest

from astraflow.state.batches import decode_flags, decode_ids
from tests.chaos.cluster import RECIPE, Cluster, ro

STAGES = 'policy.data=[{name="greso"}, {name="replay", options={ratio=0.25}}]'


def stage_state_matches_events(db: sqlite3.Connection) -> dict[int, dict]:
    """Every counter of the stages equals what the tables it counts hold; returns the state."""
    st = {
        int(k): json.loads(v)
        for k, v in db.execute("SELECT stage, state FROM stage_state WHERE policy='main'")
    }
    groups = db.execute("SELECT COUNT(DISTINCT task_id) FROM trajectories WHERE policy='main'").fetchone()[0]
    tasks = db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    replayed = sum(
        sum(decode_flags(f, len(decode_ids(i))))
        for i, f in db.execute("SELECT traj_ids, replay FROM batches WHERE policy='main'")
    )
    counters, greso, replay = st[-1], st[0], st[1]
    assert groups > 0 and tasks > 0
    assert counters["groups_kept"] + counters["groups_dropped"] == groups
    assert counters["prompts_submitted"] == tasks
    assert greso["observed"] == groups and greso["counts"]["submitted"] == tasks
    assert replay["replayed"] == replayed
    return st


@pytest.mark.chaos
@pytest.mark.timeout(600)  # several processes on 2 shared cores
def test_kill_9_keeps_stage_state_and_recipe_changes_are_checked(tiny_model: Path, tmp_path: Path) -> None:
    steps = 6
    overrides = ("policy.batch_prompts=4", "policy.group_size=8", STAGES, "controller.member_timeout_s=4.0")
    with Cluster(tmp_path, tiny_model, steps, *overrides) as c:
        ctl = c.controller("controller-1.log")
        c.raas(0)
        trainer = c.trainer()
        c.wait_steps(3, trainer, "trainer.log")
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        with ro(c.run_dir) as db:
            killed = stage_state_matches_events(db)
        resolved = (c.run_dir / "recipe.resolved.json").read_text()

        base = ["controller", str(RECIPE), "--run-dir", str(c.run_dir), "--bind", c.addr, *c.sets]
        bad = c.start([*base, "--set", "policy.group_size=4"], "controller-bad.log")
        assert bad.wait(timeout=120) == 2
        log = c.log("controller-bad.log")
        assert "differs from the one this run was started with" in log
        assert "policy[0].group_size: 8 -> 4" in log
        still = c.start(
            [*base, "--set", "policy.group_size=4", "--allow-recipe-change"], "controller-bad2.log"
        )
        assert still.wait(timeout=120) == 2
        assert "may not change" in c.log("controller-bad2.log")
        assert (c.run_dir / "recipe.resolved.json").read_text() == resolved

        ctl2 = c.start(
            [*base, "--set", "rollout.lease_timeout_s=60.0", "--allow-recipe-change"], "controller-2.log"
        )
        assert trainer.wait(timeout=300) == 0, c.log("trainer.log")
        assert ctl2.wait(timeout=60) == 0, c.log("controller-2.log")
    with ro(c.run_dir) as db:
        end = stage_state_matches_events(db)
        assert [r[0] for r in db.execute("SELECT step FROM batches ORDER BY step")] == list(
            range(1, steps + 1)
        )
        fresh = [
            i
            for ids, flags in db.execute("SELECT traj_ids, replay FROM batches")
            for i, f in zip(decode_ids(ids), decode_flags(flags, len(decode_ids(ids))), strict=True)
            if not f
        ]
        assert len(fresh) == len(set(fresh)), "a fresh trajectory was trained on twice"
        stored = json.loads(db.execute("SELECT recipe FROM runs").fetchone()[0])
    assert stored["rollout"]["lease_timeout_s"] == 60.0  # the allowed change is the run's recipe now
    assert end[0]["observed"] >= killed[0]["observed"] and end[1]["replayed"] >= killed[1]["replayed"]

"""`kill -9` of the controller mid-run: restarted on the same run directory, the run continues from
its state.db and completes; members find it again by themselves."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.cluster import Cluster, ro


@pytest.mark.chaos
def test_kill_9_controller_and_restart(tiny_model: Path, tmp_path: Path) -> None:
    steps = 10
    with Cluster(tmp_path, tiny_model, steps, "controller.member_timeout_s=3.0") as c:
        ctl = c.controller("controller-1.log")
        for i in range(2):
            c.raas(i)
        trainer = c.trainer()
        c.wait_steps(3, trainer, "trainer.log")
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        time.sleep(1.0)
        ctl2 = c.controller("controller-2.log")
        assert trainer.wait(timeout=300) == 0, c.log("trainer.log")
        assert ctl2.wait(timeout=60) == 0, c.log("controller-2.log")
    run_dir = c.run_dir
    with ro(run_dir) as db:
        assert [
            r[0] for r in db.execute("SELECT step FROM batches WHERE policy='main' ORDER BY step")
        ] == list(range(1, steps + 1))
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in json.loads(row)]
        assert len(ids) == len(set(ids)), "a trajectory was trained on twice across the restart"
        assert db.execute("SELECT MAX(version) FROM versions WHERE policy='main'").fetchone()[0] == steps
        group = json.loads((run_dir / "recipe.resolved.json").read_text())["policy"][0]["group_size"]
        per_task = dict(db.execute("SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id").fetchall())
        assert all(n == group for n in per_task.values())

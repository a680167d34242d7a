"""`kill -9` of the controller mid-run: restarted on the same run directory, the run continues from
its state.db and completes; members find it again by themselves."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.chaos.test_kill_raas import ROOT, free_port, start, steps_done


@pytest.mark.chaos
def test_kill_9_controller_and_restart(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    addr = f"tcp://127.0.0.1:{free_port()}"
    steps = 10
    ctl_args = [
        "controller",
        str(ROOT / "recipes/quickstart/recipe.toml"),
        "--run-dir",
        str(run_dir),
        "--bind",
        addr,
        "--set",
        f'policy.model="{tiny_model}"',
        "--set",
        f"run.steps={steps}",
        "--set",
        "controller.member_timeout_s=3.0",
    ]
    procs = []
    try:
        ctl = start(ctl_args, tmp_path / "controller-1.log", tmp_path)
        procs.append(ctl)
        procs += [
            start(
                ["join", "--role", "raas", "--controller", addr, "--member-id", f"raas-{i}"],
                tmp_path / f"raas-{i}.log",
                tmp_path,
            )
            for i in range(2)
        ]
        trainer = start(
            [
                "join",
                "--role",
                "trainer",
                "--controller",
                addr,
                "--policy",
                "main",
                "--checkpoint-dir",
                str(run_dir / "checkpoints" / "main"),
            ],
            tmp_path / "trainer.log",
            tmp_path,
        )
        procs.append(trainer)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and steps_done(run_dir) < 3:
            time.sleep(0.1)
        assert steps_done(run_dir) >= 3, (tmp_path / "trainer.log").read_text()[-2000:]
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        time.sleep(1.0)
        ctl2 = start(ctl_args, tmp_path / "controller-2.log", tmp_path)
        procs.append(ctl2)
        assert trainer.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert ctl2.wait(timeout=60) == 0, (tmp_path / "controller-2.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        assert [
            r[0] for r in db.execute("SELECT step FROM batches WHERE policy='main' ORDER BY step")
        ] == list(range(1, steps + 1))
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in json.loads(row)]
        assert len(ids) == len(set(ids)), "a trajectory was trained on twice across the restart"
        assert db.execute("SELECT MAX(version) FROM versions WHERE policy='main'").fetchone()[0] == steps
        group = json.loads((run_dir / "recipe.resolved.json").read_text())["policy"][0]["group_size"]
        per_task = dict(db.execute("SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id").fetchall())
        assert all(n == group for n in per_task.values())

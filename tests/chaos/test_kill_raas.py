"""Roles started by hand, like on several machines; `kill -9` of one RaaS mid-run loses no work."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "astraflow", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def steps_done(run_dir: Path) -> int:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return 0
    return sum(1 for line in p.read_text().splitlines() if line.strip())


def ro(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True, timeout=10)


@pytest.mark.chaos
def test_kill_9_raas_mid_run_loses_no_task(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    addr = f"tcp://127.0.0.1:{free_port()}"
    steps = 12
    sets = [
        "--set",
        f'policy.model="{tiny_model}"',
        "--set",
        f"run.steps={steps}",
        "--set",
        "controller.member_timeout_s=2.0",
        "--set",
        "rollout.lease_timeout_s=60",
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ctl = start(
            [
                "controller",
                str(ROOT / "recipes/quickstart/recipe.toml"),
                "--run-dir",
                str(run_dir),
                "--bind",
                addr,
                *sets,
            ],
            tmp_path / "controller.log",
            tmp_path,
        )
        procs.append(ctl)
        raas = [
            start(
                ["join", "--role", "raas", "--controller", addr, "--member-id", f"raas-{i}"],
                tmp_path / f"raas-{i}.log",
                tmp_path,
            )
            for i in range(2)
        ]
        procs += raas
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
        victim_tasks: list[int] = []
        while time.monotonic() < deadline and steps_done(run_dir) < 3:
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-2000:]
            time.sleep(0.2)
        assert steps_done(run_dir) >= 3
        # status from the live controller and from the run directory, while the run goes on
        for where in (["--controller", addr], ["--run-dir", str(run_dir)]):
            out = subprocess.run(
                [sys.executable, "-m", "astraflow", "status", *where, "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            assert {"policies", "members", "tasks"} <= set(doc)
            assert doc["policies"][0]["name"] == "main" and doc["policies"][0]["step"] >= 3
            assert {m["id"] for m in doc["members"] if m["role"] == "raas"} == {"raas-0", "raas-1"}
            # started without --slots: the controller learns them from heartbeats (busy + free)
            assert all(m["slots"] > 0 for m in doc["members"] if m["role"] == "raas"), doc["members"]
            assert set(doc["tasks"]) >= {"queued", "leased", "done", "failed"}
        # kill raas-0 while it holds leases
        while time.monotonic() < deadline:
            with ro(run_dir) as db:
                victim_tasks = [
                    r[0] for r in db.execute("SELECT id FROM tasks WHERE status='leased' AND owner='raas-0'")
                ]
            if victim_tasks:
                break
            time.sleep(0.02)
        raas[0].send_signal(signal.SIGKILL)
        raas[0].wait()

        assert trainer.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-2000:]
        assert ctl.wait(timeout=60) == 0, (tmp_path / "controller.log").read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    assert victim_tasks, "raas-0 never held a lease"
    with ro(run_dir) as db:
        group = json.loads((run_dir / "recipe.resolved.json").read_text())["policy"][0]["group_size"]
        # every done task has exactly one group of trajectories: nothing done twice
        per_task = dict(db.execute("SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id").fetchall())
        done = [r[0] for r in db.execute("SELECT id FROM tasks WHERE status='done'")]
        assert done and all(per_task.get(t) == group for t in done), {t: per_task.get(t) for t in done}
        assert set(per_task) <= set(done), "trajectories of a task that is not done"
        # what raas-0 held when it died was taken back: done by someone else, or back in the queue
        for t in victim_tasks:
            status, owner, epoch = db.execute(
                "SELECT status, owner, epoch FROM tasks WHERE id=?", (t,)
            ).fetchone()
            assert status in ("done", "queued"), (t, status)
            if status == "done":
                assert epoch >= 2, "a task of the dead worker was completed without being re-leased"
        assert db.execute("SELECT status FROM members WHERE id='raas-0'").fetchone()[0] == "dead"
        # no trajectory consumed by two steps
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in json.loads(row)]
        assert len(ids) == len(set(ids))
    assert steps_done(run_dir) == steps

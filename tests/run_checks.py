"""What the tests that end a run through faults, scaling or restarts read from its state.db, and the
checks they share: every step once, every done task one whole group, nothing trained twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from astraflow.state.batches import decode_ids

Wait = Callable[[str, Callable[[], object]], None]
"""wait(what, condition): returns once condition() is true, fails the test when the run ends first."""


def autoscale_sets(model: Path, steps: int) -> list[str]:
    """The recipe overrides the autoscale tests (`up`, Slurm, Ray) share: the quickstart on `model`,
    4 prompts of 8 a step, 2 slots a worker, a pool of 1 to 2 workers that acts every half second with
    no window, and a member timeout long enough for a worker stopped on purpose to stay a member
    holding its leases while the pool acts (and a replacement under its name joins only once it fell
    silent this long)."""
    return [
        f'policy.model="{model}"',
        f"run.steps={steps}",
        "policy.batch_prompts=4",
        "policy.group_size=8",
        "rollout.slots=2",
        "rollout.drain_timeout_s=5",
        "controller.member_timeout_s=30",
        "rollout.autoscale.enabled=true",
        "rollout.autoscale.min=1",
        "rollout.autoscale.max=2",
        "rollout.autoscale.up_busy_fraction=0.5",
        "rollout.autoscale.window_s=0",
        "rollout.autoscale.cooldown_s=1",
        "rollout.autoscale.interval_s=0.5",
    ]


def rows(run_dir: Path, sql: str, *args: object) -> list[tuple[Any, ...]]:
    """Rows of a query on the run's state.db (read-only); none before the controller made its tables."""
    if not (run_dir / "state.db").is_file():
        return []
    try:
        with closing(sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True, timeout=10)) as db:
            return db.execute(sql, args).fetchall()
    except sqlite3.OperationalError:
        return []


def demand(run_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The live controller's demand, asked as the run's observer."""
    keys = run_dir / "keys"
    cmd = [sys.executable, "-m", "astraflow", "status", "--json"]
    cmd += ["--controller", (run_dir / "controller.addr").read_text().strip()]
    cmd += [
        "--key",
        str(keys / "members/observer.key_secret"),
        "--controller-key",
        str(keys / "controller.key"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout)["demand"])


def stop_while_holding(
    run_dir: Path,
    wait: Wait,
    member: str = "raas-0",
    env: dict[str, str] | None = None,
    pid_of: Callable[[], int] | None = None,
    ask: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """SIGSTOP `member` at a moment the live controller sees it holding a lease while tasks wait;
    returns its pid. The run cannot move on without another worker from then on.

    It is stopped as soon as its state.db rows show a lease (a worker of 2 slots holds one nearly all
    the time), then the controller's demand is asked until it shows tasks waiting: the trainer's
    batch polls keep refilling the queue while the stopped worker holds its leases, so waiting for the
    queue cannot race the run's end. Only a worker caught between its results and its next lease is
    let go again. `pid_of` (the member's pid; default its members row) and `ask` (the demand; default
    `demand(run_dir, env)`) let a launcher whose roles live elsewhere supply their own."""
    leased = "SELECT COUNT(*) FROM tasks WHERE status='leased' AND owner=?"

    def holds() -> bool:
        got = rows(run_dir, leased, member)
        return bool(got and got[0][0])

    def default_pid() -> int:
        return int(rows(run_dir, "SELECT pid FROM members WHERE id=?", member)[0][0])

    for _ in range(30):
        wait(f"{member} to hold a lease", holds)
        pid = (pid_of or default_pid)()
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while True:
            now = ask() if ask is not None else demand(run_dir, env)
            if not {w["id"]: w["leased"] for w in now["workers"]}.get(member):
                break  # caught between its results and its next lease
            if now["waiting"]:
                return pid
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)
        os.kill(pid, signal.SIGCONT)
    pytest.fail(f"{member} was never stopped holding a lease while tasks waited")


def assert_run_intact(run_dir: Path, steps: int, group: int) -> None:
    """Every step of policy main trained once, every done task one whole group and nothing of a task not
    done, no task failed, no trajectory trained on twice."""
    trained = [r[0] for r in rows(run_dir, "SELECT step FROM metrics WHERE policy='main' ORDER BY id")]
    assert sorted(trained) == list(range(1, steps + 1)), trained
    per_task = dict(rows(run_dir, "SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id"))
    done = [r[0] for r in rows(run_dir, "SELECT id FROM tasks WHERE status='done'")]
    assert done and all(per_task.get(t) == group for t in done), "a task done twice or partly"
    assert set(per_task) <= set(done), "trajectories of a task that is not done"
    assert not rows(run_dir, "SELECT COUNT(*) FROM tasks WHERE status='failed'")[0][0], "a task failed"
    ids = [i for (row,) in rows(run_dir, "SELECT traj_ids FROM batches") for i in decode_ids(row)]
    assert len(ids) == len(set(ids)), "a trajectory trained on twice"

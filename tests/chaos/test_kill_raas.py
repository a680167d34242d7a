"""Roles started by hand, like on several machines; `kill -9` of one RaaS mid-run loses no work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astraflow.state.batches import decode_ids
from tests.chaos.cluster import Cluster, ro


@pytest.mark.chaos
@pytest.mark.timeout(600)  # its subprocesses have their own, longer limits
def test_kill_9_raas_mid_run_loses_no_task(tiny_model: Path, tmp_path: Path) -> None:
    steps = 12
    # 24 new tokens instead of the quickstart's 3: a grant's episodes take long enough that raas-0 is
    # caught holding leases it has not reported yet (it sends a grant's results together, in one message)
    with Cluster(
        tmp_path,
        tiny_model,
        steps,
        "controller.member_timeout_s=2.0",
        "rollout.lease_timeout_s=60",
        "policy.sampling.max_new_tokens=24",
    ) as c:
        ctl = c.controller()
        raas = [c.raas(i) for i in range(2)]
        trainer = c.trainer()
        c.wait_steps(3, trainer, "trainer.log")
        # status from the live controller and from the run directory, while the run goes on
        for where in (["--controller", c.addr], ["--run-dir", str(c.run_dir)]):
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
        deadline = time.monotonic() + 240

        def held_by_raas0() -> list[int]:
            with ro(c.run_dir) as db:
                return [
                    r[0] for r in db.execute("SELECT id FROM tasks WHERE status='leased' AND owner='raas-0'")
                ]

        # freeze raas-0 while it holds leases, so it cannot hand them back before the kill: its episodes
        # take milliseconds, and a lease seen a moment ago may already be done (then thaw and try again)
        victim_tasks: list[int] = []
        while time.monotonic() < deadline and not victim_tasks:
            if not held_by_raas0():
                time.sleep(0.02)
                continue
            raas[0].send_signal(signal.SIGSTOP)
            time.sleep(0.3)  # a result sent just before the freeze reaches the controller: not a victim
            # what it holds now, well inside controller.member_timeout_s (the leases are not yet taken back)
            victim_tasks = held_by_raas0()
            if not victim_tasks:
                raas[0].send_signal(signal.SIGCONT)
        raas[0].send_signal(signal.SIGKILL)
        raas[0].wait()

        assert trainer.wait(timeout=300) == 0, c.log("trainer.log")
        assert ctl.wait(timeout=60) == 0, c.log("controller.log")

    assert victim_tasks, "raas-0 never held a lease"
    with ro(c.run_dir) as db:
        group = json.loads((c.run_dir / "recipe.resolved.json").read_text())["policy"][0]["group_size"]
        # every done task has exactly one group of trajectories: nothing done twice
        per_task = dict(db.execute("SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id").fetchall())
        done = [r[0] for r in db.execute("SELECT id FROM tasks WHERE status='done'")]
        assert done and all(per_task.get(t) == group for t in done), {t: per_task.get(t) for t in done}
        assert set(per_task) <= set(done), "trajectories of a task that is not done"
        # what raas-0 held when it died was taken back: done by someone else, or back in the queue. A
        # result it sent just before the freeze may still have landed after the read above (a loaded
        # controller reads it late): such a task is done under raas-0's own lease, accepted before the
        # controller declared raas-0 dead; after that, a result under its lease is refused.
        died = max(
            t
            for t, d in db.execute("SELECT time, detail FROM events WHERE kind='member_dead'")
            if d.startswith("raas-0 ")
        )
        for t in victim_tasks:
            status, owner, epoch, updated = db.execute(
                "SELECT status, owner, epoch, updated FROM tasks WHERE id=?", (t,)
            ).fetchone()
            assert status in ("done", "queued"), (t, status)
            if status == "done" and epoch < 2:
                assert owner == "raas-0" and updated < died, (
                    "a task of the dead worker was completed without being re-leased"
                )
        assert db.execute("SELECT status FROM members WHERE id='raas-0'").fetchone()[0] == "dead"
        # no trajectory consumed by two steps
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in decode_ids(row)]
        assert len(ids) == len(set(ids))
    assert c.steps_done() == steps

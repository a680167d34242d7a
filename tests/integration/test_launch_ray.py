"""`astraflow launch ray` on a real local Ray cluster (a head node and a worker node on this machine,
`fake_gpu` standing in for GPUs): the quickstart runs as Ray actors, a RaaS actor killed with
kill -9 is replaced, and the autoscaler adds a worker under load and drains one while admission is
paused, with nothing lost: every step once, every done task one group, no trajectory trained twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from astraflow.state.batches import decode_ids
from tests.chaos.cluster import free_port, ro
from tests.integration.ray_local import GPU_RESOURCE, LocalRay, skip_reason

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRay]:
    cluster = LocalRay(head_cpus=2, worker_cpus=4, worker_gpus=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _wait(
    what: str, cond: Callable[[], object], proc: subprocess.Popen[bytes], out: Path, timeout: float = 240
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(
                f"launch exited {proc.returncode} while waiting for {what}:\n{out.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{out.read_text()[-4000:]}")
        time.sleep(0.2)


def _info(run_dir: Path, member: str) -> dict[str, object]:
    path = run_dir / "launch" / "ray" / f"{member}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _rows(run_dir: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    """Rows of a query on the run's state.db; none before the controller made its tables."""
    if not (run_dir / "state.db").is_file():
        return []
    try:
        with ro(run_dir) as db:
            return db.execute(sql, args).fetchall()
    except sqlite3.OperationalError:
        return []


def _alive(run_dir: Path) -> set[str]:
    return {str(r[0]) for r in _rows(run_dir, "SELECT id FROM members WHERE status='alive' AND role='raas'")}


def _steps(run_dir: Path) -> list[int]:
    return [
        int(str(r[0])) for r in _rows(run_dir, "SELECT step FROM metrics WHERE policy='main' ORDER BY id")
    ]


def _leased_by(run_dir: Path, member: str) -> list[int]:
    sql = "SELECT id FROM tasks WHERE status='leased' AND owner=?"
    return [int(str(r[0])) for r in _rows(run_dir, sql, member)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# a Ray cluster and five role processes on two loaded cores: well past the suite's 300 s default
@pytest.mark.timeout(600)
def test_quickstart_through_launch_ray_replaces_and_autoscales(
    ray_cluster: LocalRay, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    sets = [
        f'policy.model="{tiny_model}"',
        f"run.steps={STEPS}",
        "policy.batch_prompts=4",
        "policy.group_size=8",
        "rollout.slots=2",
        "rollout.local_workers=1",
        "rollout.drain_timeout_s=5",
        "rollout.autoscale.enabled=true",
        "rollout.autoscale.min=1",
        "rollout.autoscale.max=2",
        "rollout.autoscale.window_s=0",
        "rollout.autoscale.cooldown_s=1",
        "rollout.autoscale.interval_s=0.5",
    ]
    out = tmp_path / "launch.out"
    cmd = [sys.executable, "-m", "astraflow", "launch", "ray", str(ROOT / "recipes/quickstart/recipe.toml")]
    cmd += ["--address", ray_cluster.address, "--run-dir", str(run_dir), "--cpus-per-role", "0.5"]
    metrics_port = free_port()
    cmd += ["--trainer-gpus", "--gpu-resource", GPU_RESOURCE, "--metrics-bind", f"127.0.0.1:{metrics_port}"]
    cmd += [a for s in sets for a in ("--set", s)]
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=ray_cluster.env, cwd=tmp_path)
    try:
        # tasks wait and both slots of raas-0 are busy: the autoscaler adds raas-1
        _wait("the autoscaler to add raas-1", lambda: "autoscale: added raas-1" in out.read_text(), proc, out)
        # kill -9 the process of raas-0's actor, the only worker so far: the driver replaces it, and the
        # run waits for a worker meanwhile, so admission is paused well before the budget is reached
        victim = _info(run_dir, "raas-0")
        held = _leased_by(run_dir, "raas-0")
        os.kill(int(str(victim["actor_pid"])), signal.SIGKILL)
        # with admission held the pool idles, and the autoscaler drains a worker
        subprocess.run(
            [sys.executable, "-m", "astraflow", "ctl", "pause", "--run-dir", str(run_dir)],
            check=True,
            env=ray_cluster.env,
            capture_output=True,
            timeout=60,
        )
        assert max(_steps(run_dir), default=0) < STEPS, "the run was over before the kill"
        trainer = _info(run_dir, "trainer-main")
        assert trainer["resources"] == {"CPU": 0.5, GPU_RESOURCE: 1.0}, trainer
        assert trainer["placement_group"], "the GPU role was not placed by a placement group"
        # the live controller's demand (with its admission room), from any node through RUN/controller.addr
        keys = run_dir / "keys"
        assert "0.0.0.0" not in (run_dir / "controller.addr").read_text()  # the address other nodes reach
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "astraflow",
                "status",
                "--json",
                "--controller",
                (run_dir / "controller.addr").read_text().strip(),
            ]
            + [
                "--key",
                str(keys / "members/observer.key_secret"),
                "--controller-key",
                str(keys / "controller.key"),
            ],
            env=ray_cluster.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        demand = json.loads(status.stdout)["demand"]
        assert isinstance(demand["room"]["main"], int) and demand["slots"] >= 0, demand
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            assert 'astraflow_up{run="quickstart"} 1' in r.read().decode()
        _wait(
            "raas-0 to be replaced",
            lambda: _info(run_dir, "raas-0").get("actor_pid") not in (None, victim["actor_pid"]),
            proc,
            out,
        )
        # the role died with its actor: no orphan keeps the member's name
        _wait("the killed role to exit", lambda: not _pid_alive(int(str(victim["pid"]))), proc, out, 30)
        _wait("a drain", lambda: "autoscale: draining" in out.read_text(), proc, out)
        drained = out.read_text().split("autoscale: draining ")[1].split()[0]
        _wait(f"{drained} to leave", lambda: f"{drained} left (exit 0)" in out.read_text(), proc, out)
        subprocess.run(
            [sys.executable, "-m", "astraflow", "ctl", "resume", "--run-dir", str(run_dir)],
            check=True,
            env=ray_cluster.env,
            capture_output=True,
            timeout=60,
        )
        assert proc.wait(timeout=300) == 0, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    text = out.read_text()
    assert "raas-0 stopped (its actor died): replacing it" in text, text[-3000:]
    assert sorted(_steps(run_dir)) == list(range(1, STEPS + 1))
    with ro(run_dir) as db:
        group = 8
        per_task = dict(db.execute("SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id").fetchall())
        done = [r[0] for r in db.execute("SELECT id FROM tasks WHERE status='done'")]
        assert done and all(per_task.get(t) == group for t in done), "a task done twice or partly"
        assert set(per_task) <= set(done), "trajectories of a task that is not done"
        assert not db.execute("SELECT COUNT(*) FROM tasks WHERE status='failed'").fetchone()[0]
        for t in held:  # what the killed worker held was taken back and done again, or is still queued
            status, epoch = db.execute("SELECT status, epoch FROM tasks WHERE id=?", (t,)).fetchone()
            assert status in ("done", "queued") and (status == "queued" or epoch >= 2), (t, status, epoch)
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in decode_ids(row)]
        assert len(ids) == len(set(ids)), "a trajectory trained on twice"
        events = [r[0] for r in db.execute("SELECT detail FROM events WHERE kind='member_left'")]
        assert any(e.startswith(drained) for e in events), events
    # every actor and placement group was released: the cluster's resources are whole again
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
        "import json; print(json.dumps(ray.available_resources()))"
    )
    probe += "; import time; time.sleep(2); print(json.dumps(ray.available_resources()))"
    left = subprocess.run(
        [sys.executable, "-c", probe, ray_cluster.address],
        capture_output=True,
        text=True,
        env=ray_cluster.env,
        timeout=120,
    )
    avail = json.loads(left.stdout.strip().splitlines()[-1])
    assert avail.get(GPU_RESOURCE) == 2.0 and avail.get("CPU") == 6.0, avail

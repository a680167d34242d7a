"""`astraflow launch ray` on a real local Ray cluster (a head node and a worker node on this machine,
in a network namespace of the test's own so everything stays on loopback; `fake_gpu` stands in for
GPUs): the quickstart runs as Ray actors, the autoscaler adds a worker while work waits, a RaaS actor
killed with kill -9 is replaced, and the autoscaler drains a worker while admission is paused, with
nothing lost: every step once, every done task one group, no trajectory trained twice.

Each phase waits for what the run records, never for the clock: the only worker is stopped (SIGSTOP)
while it holds a lease and tasks wait, so the run cannot progress, and cannot end, until the
autoscaler's new worker has been seen; admission is then paused until the drain is seen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.ray_local import GPU_RESOURCE, LocalRay, skip_reason
from tests.ports import free_port
from tests.run_checks import assert_run_intact, autoscale_sets, rows, stop_while_holding

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
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


def _info(run_dir: Path, member: str) -> dict[str, Any]:
    path = run_dir / "launch" / "ray" / f"{member}.json"
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _steps(run_dir: Path) -> list[int]:
    return [int(str(r[0])) for r in rows(run_dir, "SELECT step FROM metrics WHERE policy='main' ORDER BY id")]


def _leased_by(run_dir: Path, member: str) -> list[int]:
    sql = "SELECT id FROM tasks WHERE status='leased' AND owner=?"
    return [int(str(r[0])) for r in rows(run_dir, sql, member)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _astraflow(cluster: LocalRay, *args: str) -> str:
    """`astraflow ARGS` inside the cluster's namespace; its stdout (it must exit 0)."""
    done = cluster.run([sys.executable, "-m", "astraflow", *args])
    assert done.returncode == 0, done.stderr
    return done.stdout


def _demand(cluster: LocalRay, run_dir: Path) -> dict[str, Any]:
    """The live controller's demand, asked as an observer from the cluster's namespace."""
    keys = run_dir / "keys"
    args = ["status", "--json", "--controller", (run_dir / "controller.addr").read_text().strip()]
    args += [
        "--key",
        str(keys / "members/observer.key_secret"),
        "--controller-key",
        str(keys / "controller.key"),
    ]
    return dict(json.loads(_astraflow(cluster, *args))["demand"])


# a Ray cluster and five role processes on two loaded cores: well past the suite's 300 s default
@pytest.mark.timeout(900)
def test_quickstart_through_launch_ray_replaces_and_autoscales(
    ray_cluster: LocalRay, tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    sets = [*autoscale_sets(tiny_model, STEPS), "rollout.local_workers=1"]  # workers started by the launcher
    out = tmp_path / "launch.out"
    cmd = [sys.executable, "-m", "astraflow", "launch", "ray", str(ROOT / "recipes/quickstart/recipe.toml")]
    cmd += ["--address", ray_cluster.address, "--run-dir", str(run_dir), "--cpus-per-role", "0.5"]
    metrics_port = free_port()
    cmd += ["--trainer-gpus", "--gpu-resource", GPU_RESOURCE, "--metrics-bind", f"127.0.0.1:{metrics_port}"]
    cmd += [a for s in sets for a in ("--set", s)]
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            ray_cluster.cmd(cmd), stdout=sink, stderr=subprocess.STDOUT, env=ray_cluster.env, cwd=tmp_path
        )
    try:
        # the only worker hangs holding a lease while tasks wait: the run is held until a worker is added
        stop_while_holding(
            run_dir,
            lambda what, cond: _wait(what, lambda: _info(run_dir, "raas-0") and cond(), proc, out),
            pid_of=lambda: int(_info(run_dir, "raas-0")["pid"]),
            ask=lambda: _demand(ray_cluster, run_dir),
        )
        held = _leased_by(run_dir, "raas-0")
        _wait("the autoscaler to add raas-1", lambda: "autoscale: added raas-1" in out.read_text(), proc, out)
        # admission is held from here until the drain is seen, so the run cannot end before it
        _astraflow(ray_cluster, "ctl", "pause", "--run-dir", str(run_dir))
        assert max(_steps(run_dir), default=0) < STEPS, "the run was over before the kill"
        # kill -9 the process of raas-0's actor: the driver replaces it, and its role (stopped) dies with it
        victim = _info(run_dir, "raas-0")
        os.kill(int(victim["actor_pid"]), signal.SIGKILL)
        trainer = _info(run_dir, "trainer-main")
        assert trainer["resources"] == {"CPU": 0.5, GPU_RESOURCE: 1.0}, trainer
        assert trainer["placement_group"], "the GPU role was not placed by a placement group"
        # the address other nodes reach, on loopback inside the namespace
        assert (run_dir / "controller.addr").read_text().startswith("tcp://127.0.0.1:")
        demand = _demand(ray_cluster, run_dir)
        assert isinstance(demand["room"]["main"], int) and demand["slots"] >= 0, demand
        scrape = f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{metrics_port}/metrics').read().decode())"
        assert 'astraflow_up{run="quickstart"} 1' in ray_cluster.run([sys.executable, "-c", scrape]).stdout
        _wait(
            "raas-0 to be replaced",
            lambda: _info(run_dir, "raas-0").get("actor_pid") not in (None, victim["actor_pid"]),
            proc,
            out,
        )
        # the role died with its actor: no orphan keeps the member's name
        _wait("the killed role to exit", lambda: not _pid_alive(int(victim["pid"])), proc, out, 60)
        # with admission paused the pool idles, and the autoscaler drains a worker
        _wait("a drain", lambda: "autoscale: draining" in out.read_text(), proc, out)
        drained = out.read_text().split("autoscale: draining ")[1].split()[0]
        _wait(f"{drained} to leave", lambda: f"{drained} left (exit 0)" in out.read_text(), proc, out)
        _astraflow(ray_cluster, "ctl", "resume", "--run-dir", str(run_dir))
        assert proc.wait(timeout=400) == 0, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    text = out.read_text()
    assert "raas-0 stopped (its actor died): replacing it (1/3)" in text, text[-3000:]
    assert_run_intact(run_dir, STEPS, group=8)
    # what the stopped and killed worker held was taken back and done again, or is still queued
    for t in held:
        ((status, epoch),) = rows(run_dir, "SELECT status, epoch FROM tasks WHERE id=?", t)
        assert status in ("done", "queued") and (status == "queued" or int(str(epoch)) >= 2), (
            t,
            status,
            epoch,
        )
    events = [str(r[0]) for r in rows(run_dir, "SELECT detail FROM events WHERE kind='member_left'")]
    assert any(e.startswith(drained) for e in events), events
    # every actor and placement group was released: the cluster's resources are whole again
    probe = (
        "import json, ray, sys, time; ray.init(address=sys.argv[1], log_to_driver=False); "
        "print(json.dumps(ray.available_resources())); time.sleep(2); print(json.dumps(ray.available_resources()))"
    )
    left = ray_cluster.run([sys.executable, "-c", probe, ray_cluster.address])
    avail = json.loads(left.stdout.strip().splitlines()[-1])
    assert avail.get(GPU_RESOURCE) == 2.0 and avail.get("CPU") == 6.0, avail

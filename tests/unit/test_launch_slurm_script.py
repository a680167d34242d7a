"""The generated sbatch script: roles placed on nodes, trainers with their ranks and GPUs, every
member with its own key, the offline switches, valid bash (no cluster needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from astraflow.cluster.plan import Member, Plan
from astraflow.cluster.slurm import SlurmOptions, render, render_worker

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path) -> Plan:
    trainers = [Member("trainer-a", "trainer", "a", 4), Member("trainer-b", "trainer", "b", 1)]
    raas = [Member(f"raas-{i}", "raas") for i in range(3)]
    return Plan(tmp_path / "run", trainers, raas, slots=16)


def test_script_places_roles_and_passes_keys(tmp_path: Path) -> None:
    script = render(
        _plan(tmp_path),
        SlurmOptions(nodes=5, python="/env/bin/python", port=7611, gpus_per_node=8, offline=True),
    )
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert "#SBATCH --nodes=5" in script and "#SBATCH --gpus-per-node=8" in script
    lines = script.splitlines()

    def step(name: str) -> str:
        i = next(i for i, line in enumerate(lines) if f"--job-name={name} " in line)
        return lines[i] + lines[i + 1]

    assert '-w "${NODES[0]}"' in step("controller") and "--bind tcp://0.0.0.0:7611" in step("controller")
    assert (
        '-w "${NODES[0]}"' in step("trainer-a")
        and "--gpus=4" in step("trainer-a")
        and "--nproc 4" in step("trainer-a")
    )
    assert '-w "${NODES[1]}"' in step("trainer-b") and "--nproc" not in step("trainer-b")
    assert (
        '-w "${NODES[4]}"' in step("raas-2")
        and "--gpus=8" in step("raas-2")
        and "--slots 16" in step("raas-2")
    )
    for name in ("trainer-a", "trainer-b", "raas-0", "raas-1", "raas-2"):
        assert f'--member-id {name} --key "$KEYS/members/{name}.key_secret"' in step(name)
    assert '--checkpoint-dir "$RUN/checkpoints/a"' in step("trainer-a")
    assert "HF_HUB_OFFLINE=1" in script and "TRANSFORMERS_OFFLINE=1" in script
    assert 'CONTROLLER="tcp://${NODES[0]}:7611"' in script


def test_fewer_nodes_share_round_robin(tmp_path: Path) -> None:
    script = render(_plan(tmp_path), SlurmOptions(nodes=2, python="py", port=7600))
    assert "--gpus=" not in script and "OFFLINE" not in script
    assert "NODES[2]" not in script and "NODES[3]" not in script
    assert script.count('-w "${NODES[1]}"') == 2  # trainer-b and raas-1


def test_autoscale_runs_the_pool_loop_and_worker_jobs_are_valid_scripts(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    opts = SlurmOptions(nodes=5, python="/env/bin/python", port=7600, gpus_per_node=8, autoscale=True)
    script = render(plan, opts)
    assert "astraflow.cluster.slurm_pool" not in render(plan, SlurmOptions(nodes=5, python="py", port=1))
    pool = next(line for line in script.splitlines() if "astraflow.cluster.slurm_pool" in line)
    pool += script.split(pool, 1)[1].splitlines()[1]
    for j in range(3):  # every worker step of the main job is in the pool, by its srun pid
        assert f'--worker raas-{j}="${{RAAS_PIDS[{j}]}}"' in pool
    assert '--controller "$CONTROLLER"' in pool and '--controller-pid "$CONTROLLER_PID"' in pool
    assert 'kill -TERM "$POOL_PID"' in script
    worker = render_worker(plan, opts, "raas-5")
    path = tmp_path / "raas-5.sbatch"
    path.write_text(worker)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert "#SBATCH --nodes=1" in worker and "#SBATCH --gpus-per-node=8" in worker
    assert '--member-id raas-5 --key "$KEYS/members/raas-5.key_secret"' in worker
    assert f"RUN={plan.run_dir}" in worker and "--slots 16" in worker
    # the controller's address is the job's argument; without it the job stops before joining
    done = subprocess.run(["bash", str(path)], capture_output=True, text=True)
    assert done.returncode != 0 and "usage: sbatch THIS_SCRIPT" in done.stderr


def test_launch_slurm_refuses_a_starting_pool_outside_the_bounds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astraflow", "launch", "slurm", str(ROOT / "recipes/quickstart/recipe.toml")]
    cmd += ["--run-dir", str(run_dir), "--raas", "3", "--set", "rollout.autoscale.enabled=true"]
    out = subprocess.run(
        [*cmd, "--set", "rollout.autoscale.max=2"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "3 starting RaaS workers is outside rollout.autoscale.min..max (1..2)" in out.stderr
    assert "Traceback" not in out.stderr and not run_dir.exists()


# fake `srun` and `scontrol` (no cluster here): each step sleeps as its role, then exits with its code;
# a SIGTERM is recorded, so the test sees which role the script stopped instead of letting it finish
_FAKE_SRUN = """#!/bin/bash
name=$(printf '%s\\n' "$@" | sed -n 's/^--job-name=//p')
trap 'echo "$name TERM" >> "$FAKE_LOG"; exit 143' TERM
case "$name" in
    controller) sleep "$CONTROLLER_S"; code="$CONTROLLER_RC" ;;
    trainer-*) sleep 3; code=0 ;;
    *) sleep 1; code=0 ;;
esac
echo "$name exit $code" >> "$FAKE_LOG"
exit "$code"
"""


def _run_with_fake_srun(tmp_path: Path, controller_s: float, controller_rc: int) -> tuple[int, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(_FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    plan = Plan(
        tmp_path / "run", [Member("trainer-a", "trainer", "a", 1)], [Member("raas-0", "raas")], slots=2
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render(plan, SlurmOptions(nodes=1, python="py", port=7600, stop_grace_s=20)))
    log = tmp_path / "fake.log"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "node0",
        "SLURM_JOB_ID": "1",
        "FAKE_LOG": str(log),
        "CONTROLLER_S": str(controller_s),
        "CONTROLLER_RC": str(controller_rc),
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, log.read_text() + done.stderr


def test_a_controller_that_finished_the_run_lets_the_trainers_exit_by_themselves(tmp_path: Path) -> None:
    # the controller ends the run (exit 0) a moment before the trainer it told to stop has exited:
    # the job waits for the trainer instead of killing it, and succeeds
    rc, log = _run_with_fake_srun(tmp_path, controller_s=0.5, controller_rc=0)
    assert rc == 0, log
    assert "trainer-a exit 0" in log and "trainer-a TERM" not in log, log


def test_a_controller_that_failed_stops_the_job(tmp_path: Path) -> None:
    rc, log = _run_with_fake_srun(tmp_path, controller_s=0.5, controller_rc=3)
    # the job ends with the controller's code, not the 143 of the trainer it stopped
    assert rc == 3, log
    assert "trainer-a TERM" in log and "the controller exited with 3" in log, log

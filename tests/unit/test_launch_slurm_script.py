"""The generated sbatch script: roles placed on nodes, trainers with their ranks and GPUs, every
member with its own key, the offline switches, valid bash (no cluster needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from astraflow.cluster.plan import Member, Plan
from astraflow.cluster.slurm import SlurmOptions, render


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

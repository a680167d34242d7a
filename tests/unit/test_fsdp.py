"""FSDP2 over 2 real processes (torchrun, gloo, CPU) matches one process on the same batch, and resumes
exactly from its sharded checkpoint."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_batches import batch, policy  # noqa: E402

from astraflow.models.init import init_model  # noqa: E402
from astraflow.trainers.torch_trainer import TorchTrainer  # noqa: E402

torch.set_num_threads(1)
HERE = Path(__file__).resolve().parent


def test_fsdp_two_ranks_match_one_process_and_resume_exactly(tmp_path: Path) -> None:
    model_dir = init_model("qwen3", "tiny", tmp_path / "tiny", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(HERE / "fsdp_ranks.py"),
            str(model_dir),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = torch.load(out / "result.pt", weights_only=False)
    assert res["world"] == 2
    # The sharded checkpoint really is sharded: one set of shard files per rank.
    assert len(list((out / "ckpt" / "dcp").glob("*.distcp"))) == 2

    single = TorchTrainer(policy(model_dir), seed=3)
    loss, grads = single.batch_gradients(batch(0))
    assert res["loss"] == pytest.approx(loss, abs=1e-6)
    assert res["grads"].keys() == grads.keys()
    for name, g in grads.items():
        assert torch.allclose(res["grads"][name], g, atol=1e-6, rtol=1e-4), name
    assert any(float(g.abs().max()) > 1e-3 for g in grads.values())
    metrics = single.step(batch(0))
    assert res["metrics_a"]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert res["metrics_a"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)

    # Resuming from the sharded checkpoint and stepping again gives bit-identical weights.
    straight, resumed = res["straight"], res["resumed"]
    assert straight.keys() == resumed.keys() and "lm_head.weight" in straight
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_ranks_get_the_same_command_line_without_nproc() -> None:
    from astraflow.roles.trainer_ranks import torchrun_argv, without_nproc

    args = ["join", "--role", "trainer", "--nproc", "2", "--policy", "main", "--nproc=3", "--keys", "k"]
    assert without_nproc(args) == ["join", "--role", "trainer", "--policy", "main", "--keys", "k"]
    argv = torchrun_argv(2, without_nproc(args))
    assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert argv[5:] == ["-m", "astraflow", *without_nproc(args)]

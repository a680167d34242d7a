"""`kill -9` of the trainer between checkpoints: restarted on the same checkpoint directory, it gets the
same recorded batches again, and its final weights equal those of N steps taken straight through on
those batches (exact resume, no double training)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.test_kill_raas import ROOT, free_port, start, steps_done


@pytest.mark.chaos
def test_kill_9_trainer_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "main"
    addr = f"tcp://127.0.0.1:{free_port()}"
    steps = 8
    sets = [
        "--set",
        f'policy.model="{tiny_model}"',
        "--set",
        f"run.steps={steps}",
        "--set",
        "policy.checkpoint_every=3",
        "--set",
        "policy.batch_prompts=8",
        "--set",
        "controller.member_timeout_s=2.0",
    ]
    trainer_args = [
        "join",
        "--role",
        "trainer",
        "--controller",
        addr,
        "--policy",
        "main",
        "--checkpoint-dir",
        str(ckpt),
    ]
    procs = []
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
        procs.append(
            start(
                ["join", "--role", "raas", "--controller", addr, "--member-id", "raas-0"],
                tmp_path / "raas.log",
                tmp_path,
            )
        )
        trainer = start(trainer_args, tmp_path / "trainer-1.log", tmp_path)
        procs.append(trainer)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and steps_done(run_dir) < 4:
            time.sleep(0.05)
        assert steps_done(run_dir) >= 4, (tmp_path / "trainer-1.log").read_text()[-2000:]
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        killed_at = steps_done(run_dir)
        assert killed_at < steps, "the trainer finished before it could be killed"
        trainer2 = start(trainer_args, tmp_path / "trainer-2.log", tmp_path)
        procs.append(trainer2)
        assert trainer2.wait(timeout=300) == 0, (tmp_path / "trainer-2.log").read_text()[-3000:]
        assert ctl.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "resumed main from" in (tmp_path / "trainer-2.log").read_text()

    # Replay the recorded batches 1..N in one fresh trainer, straight through, in this process.
    import torch
    from safetensors.torch import load_file

    from astraflow.config.load import validate_recipe
    from astraflow.dataflow.buffer import Buffer
    from astraflow.state.store import Store
    from astraflow.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    recipe = validate_recipe(json.loads((run_dir / "recipe.resolved.json").read_text()))
    store = Store.open_readonly(run_dir / "state.db")
    try:
        buf = Buffer(store)
        batches = [buf.recorded("main", k) for k in range(1, steps + 1)]
    finally:
        store.close()
    assert all(b is not None for b in batches)
    ids = [s.traj_id for b in batches if b is not None for s in b.samples]
    assert len(ids) == len(set(ids)), "a trajectory was trained on twice"
    straight = TorchTrainer(recipe.get_policy("main"), seed=recipe.run.seed, device="cpu")
    for b in batches:
        assert b is not None
        straight.step(b.samples)
    resumed = load_file(str(ckpt / f"step-{steps}" / "model.safetensors"))
    mine = {k: v.detach().cpu() for k, v in straight.export_weights().items()}
    assert set(resumed) <= set(mine)
    mismatched = [k for k in resumed if not torch.equal(resumed[k], mine[k])]
    assert mismatched == [], mismatched[:5]

"""`kill -9` of the trainer between checkpoints: restarted on the same checkpoint directory, it gets the
same recorded batches again, and its final weights equal those of N steps taken straight through on
those batches (exact resume, no double training)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.chaos.cluster import Cluster


@pytest.mark.chaos
@pytest.mark.timeout(600)  # its subprocesses have their own, longer limits
def test_kill_9_trainer_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    steps = 8
    overrides = ("policy.checkpoint_every=3", "policy.batch_prompts=8", "controller.member_timeout_s=2.0")
    with Cluster(tmp_path, tiny_model, steps, *overrides) as c:
        ctl = c.controller()
        c.raas(0)
        trainer = c.trainer("trainer-1.log")
        c.wait_steps(4, trainer, "trainer-1.log")
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert c.steps_done() < steps, "the trainer finished before it could be killed"
        trainer2 = c.trainer("trainer-2.log")
        assert trainer2.wait(timeout=300) == 0, c.log("trainer-2.log")
        assert ctl.wait(timeout=60) == 0
    assert "resumed main from" in c.log("trainer-2.log", tail=100_000)
    run_dir, ckpt = c.run_dir, c.checkpoints

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

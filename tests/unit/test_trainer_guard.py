"""The trainer refuses to learn from garbage: an update whose loss is not finite (a sequence sampled at
temperature 1e-300: 1/T is inf in float32) is skipped with no weight touched and reported, N such
steps in a row stop the trainer with the reason, and non-finite weights are found before publishing."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"


import pytest
import torch

from astraflow.config.recipe import OptimizerConfig, PolicyConfig
from astraflow.errors import AstraflowError
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams, TrainSample
from astraflow.trainers.guard import SkipGuard, finite_metrics, nonfinite_weights, step_problem
from astraflow.trainers.torch_trainer import TorchTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> TorchTrainer:
    model = init_model("qwen3", "tiny", tmp_path_factory.mktemp("guard") / "tiny", seed=0)
    pol = PolicyConfig(model=str(model), optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0))
    return TorchTrainer(pol, seed=0)


def _batch(temperature: float) -> list[TrainSample]:
    return [
        TrainSample(
            traj_id=i,
            tokens=[1, 5, 6, 7, 8, 9],
            loss_mask=[0, 0, 1, 1, 1, 1],
            logprobs=[0.0, 0.0, -2.0, -2.0, -2.0, -2.0],
            versions=[-1, -1, 0, 0, 0, 0],
            reward=float(i % 2),
            advantage=1.0 if i % 2 else -1.0,
            sampling=SamplingParams(temperature=temperature),
        )
        for i in range(4)
    ]


def _weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_a_non_finite_loss_is_skipped_and_reported_and_a_finite_one_learns(trainer: TorchTrainer) -> None:
    before = _weights(trainer)
    steps = trainer.step_count
    metrics = trainer.step(_batch(1e-300))
    assert not torch.isfinite(torch.tensor(metrics["loss"]))  # the poison is real
    assert metrics["skipped_updates"] == 1.0
    assert step_problem(metrics).startswith("loss ")
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped update changed weights"
    assert all(p.grad is None for p in trainer.model.parameters()), "gradients were left behind"
    assert not trainer.optimizer.state, "the optimizer stepped on a skipped update"
    assert trainer.step_count == steps + 1  # the step (its batch and version) still counts
    assert "loss" not in finite_metrics(metrics) and "skipped_updates" in finite_metrics(metrics)

    good = trainer.step(_batch(1.0))
    assert good["skipped_updates"] == 0.0 and step_problem(good) == ""
    moved = _weights(trainer)
    assert any(not torch.equal(after[k], moved[k]) for k in after), "a finite step did not learn"
    assert not nonfinite_weights(moved)


def test_steps_in_a_row_without_learning_stop_the_trainer_with_the_reason() -> None:
    guard = SkipGuard("main", limit=3)
    bad = {"loss": float("nan"), "grad_norm": float("nan"), "skipped_updates": 1.0}
    for step in (1, 2):
        m = dict(bad)
        assert "loss nan" in guard.after_step(step, m)
        assert m["trainer_skipped_step"] == 1.0 and m["trainer_skipped_in_a_row"] == step
    ok = {"loss": 0.1, "grad_norm": 1.0, "skipped_updates": 0.0}
    assert guard.after_step(3, ok) == "" and ok["trainer_skipped_in_a_row"] == 0.0  # a good step resets
    guard.after_step(4, dict(bad))
    guard.after_step(5, dict(bad))
    with pytest.raises(AstraflowError, match=r"3 steps in a row \(the last: 6\).*non-finite"):
        guard.after_step(6, dict(bad))
    assert guard.total == 5


def test_non_finite_weights_are_named() -> None:
    w = {"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")]), "c": torch.tensor([float("nan")])}
    w["ids"] = torch.tensor([1, 2])  # integer buffers are not checked
    assert nonfinite_weights(w) == ["b", "c"]
    assert nonfinite_weights({"a": torch.zeros(2)}) == []
    assert nonfinite_weights({"huge": torch.full((4,), 3e38)}) == []  # its sum overflows; it is finite
    assert nonfinite_weights({"half": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)}) == ["half"]


def test_the_progress_line_of_up_says_a_step_was_skipped() -> None:
    from astraflow.launch.progress import progress_line

    row = {"policy": "main", "step": 4, "version": 4, "reward_mean": 0.5, "trainer_skipped_step": 1.0}
    assert progress_line(row, 10).endswith("SKIPPED: non-finite loss or gradient norm")
    assert "SKIPPED" not in progress_line({**row, "trainer_skipped_step": 0.0}, 10)

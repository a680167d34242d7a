"""Every built-in objective: plugin loading, empty masks, zero advantages, far ratios, singletons, KL."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astraflow import plugins
from astraflow.errors import PluginError
from astraflow.losses.base import Loss, LossInputs
from astraflow.losses.grpo import GRPOLoss

torch.set_num_threads(1)

NAMES = ["grpo", "drgrpo", "dapo", "gspo", "m2po", "decoupled_ppo", "tis"]


def _build(name: str, **options: object) -> Loss:
    cls = plugins.load("losses", name)
    return cls(cls.Config.model_validate(options))


def _inputs(log_ratio: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, **extra: object) -> LossInputs:
    behaviour = torch.full_like(log_ratio, -1.0)
    return LossInputs(
        logp=(behaviour + log_ratio).requires_grad_(),
        behaviour_logp=behaviour,
        mask=mask,
        advantages=adv,
        prox_logp=behaviour + 0.5 * log_ratio,
        ref_logp=behaviour,
        entropy=torch.ones_like(log_ratio),
        **extra,  # type: ignore[arg-type]
    )


def _finite(metrics: dict[str, float]) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_loss_modules_import_no_torch() -> None:
    code = (
        "import sys, " + ", ".join(f"astraflow.losses.{m}" for m in NAMES) + "; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", NAMES)
def test_plugin_loads_and_config_forbids_unknown_keys(name: str) -> None:
    cls = plugins.load("losses", name)
    assert issubclass(cls, Loss)
    with pytest.raises(ValueError):
        cls.Config.model_validate({"no_such_option": 1})
    assert _build(name, kl_coef=0.001).needs_ref is True
    assert _build(name).needs_ref is False


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("total_tokens", [None, 0.0])
def test_empty_mask_gives_finite_zero_loss_and_zero_grads(name: str, total_tokens: float | None) -> None:
    inputs = _inputs(
        torch.randn(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), total_tokens=total_tokens
    )
    loss, metrics = _build(name, kl_coef=0.1)(inputs)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(inputs.logp.grad == 0)
    assert _finite(metrics)


@pytest.mark.parametrize("name", NAMES)
def test_zero_advantages_give_zero_policy_loss_and_grads(name: str) -> None:
    inputs = _inputs(torch.randn(3, 4) * 0.1, torch.ones(3, 4), torch.zeros(3))
    loss, metrics = _build(name)(inputs)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(inputs.logp.grad == 0)
    if name != "m2po":  # M2PO's mask depends on the ratios only, not on the advantages
        assert metrics["clip_frac"] == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_far_ratios_stay_finite(name: str) -> None:
    log_ratio = torch.tensor([[5.0, -5.0, 0.0], [-5.0, 5.0, 0.01]])
    inputs = _inputs(log_ratio, torch.ones(2, 3), torch.tensor([1.0, -1.0]))
    loss, metrics = _build(name, kl_coef=0.01)(inputs)
    loss.backward()
    assert math.isfinite(loss.item()) and _finite(metrics)
    assert torch.isfinite(inputs.logp.grad).all()
    assert metrics["ratio_max"] <= math.exp(5.0) * (1 + 1e-5)


def test_far_ratios_grpo_only_the_pessimistic_side_gets_gradient() -> None:
    inputs = _inputs(torch.tensor([[5.0, -5.0]]), torch.ones(1, 2), torch.tensor([1.0]))
    loss, _ = GRPOLoss()(inputs)
    loss.backward()
    # r = e^5 with A > 0 is clipped (no gradient); r = e^-5 is below 0.8 but min() keeps the unclipped term.
    assert inputs.logp.grad[0, 0].item() == 0.0
    assert inputs.logp.grad[0, 1].item() == pytest.approx(-math.exp(-5.0) / 2, rel=1e-5)


def test_m2po_masks_far_tokens() -> None:
    inputs = _inputs(torch.tensor([[5.0, -5.0, 0.0, 0.01]]), torch.ones(1, 4), torch.tensor([1.0]))
    loss, metrics = _build("m2po")(inputs)
    loss.backward()
    assert metrics["m2po_masked_frac"] == pytest.approx(0.5)
    assert inputs.logp.grad[0, :2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("name", NAMES)
def test_singleton_sequences(name: str) -> None:
    inputs = _inputs(torch.tensor([[0.0001], [-0.0001]]), torch.ones(2, 1), torch.tensor([1.0, -1.0]))
    loss, metrics = _build(name)(inputs)
    loss.backward()
    assert math.isfinite(loss.item()) and _finite(metrics)
    assert (inputs.logp.grad.abs() > 0).all()


@pytest.mark.parametrize(("offset", "flows"), [(-1e-3, True), (1e-3, False)])
@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_clip_boundary(name: str, offset: float, flows: bool) -> None:
    high = 1.2 if name == "grpo" else 1.28
    inputs = _inputs(
        torch.tensor([[math.log(high) + offset]], dtype=torch.float64).float(),
        torch.ones(1, 1),
        torch.ones(1),
    )
    loss, metrics = _build(name)(inputs)
    loss.backward()
    assert (inputs.logp.grad.abs().item() > 0) == flows
    assert metrics["clip_frac"] == (0.0 if flows else 1.0)


@pytest.mark.parametrize("name", NAMES)
def test_kl_and_entropy_metrics_and_missing_ref(name: str) -> None:
    inputs = _inputs(torch.full((1, 2), 0.1), torch.ones(1, 2), torch.zeros(1))
    loss, metrics = _build(name, kl_coef=1.0)(inputs)
    kl = math.exp(-0.1) + 0.1 - 1  # k3 with ref - logp = -0.1; zero advantages leave only the KL
    assert metrics["kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["entropy"] == pytest.approx(1.0)
    if name != "drgrpo":
        assert loss.item() == pytest.approx(kl, rel=1e-5)
    inputs.ref_logp = None
    with pytest.raises(PluginError):
        _build(name, kl_coef=1.0)(inputs)


def test_plugin_example_in_docs_runs() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs/losses.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(block, "docs/losses.md", "exec"), namespace)
    cls = namespace["CappedISLoss"]
    loss_fn = cls(cls.Config.model_validate({"cap": 2.0, "kl_coef": 0.1}))  # type: ignore[attr-defined]
    assert loss_fn.needs_ref is True
    inputs = _inputs(torch.tensor([[0.0, 2.0]]), torch.ones(1, 2), torch.tensor([1.0]))
    loss, metrics = loss_fn(inputs)
    loss.backward()
    assert metrics["clip_frac"] == pytest.approx(0.5) and "kl" in metrics
    assert torch.isfinite(inputs.logp.grad).all()

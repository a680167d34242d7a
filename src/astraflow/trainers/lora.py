"""LoRA adapters through peft: wrap a causal LM, and export it as merged dense weights.

Only the adapters train (the base weights are frozen, so AdamW keeps state for the adapters alone);
engines receive ordinary dense weights, W + scale * B @ A per adapted layer, computed without
touching the live model (merging in place and unmerging again would drift in bf16).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError


class LoraOptions(BaseModel):
    """LoRA adapters (recipe: policy.trainer_options.lora); needs the `peft` extra."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(8, ge=1)
    """Adapter rank r."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear layers that get adapters."""
    also_train: list[str] = []
    """Parameters trained in full beside the adapters: name fragments, e.g. "norm" for every RMSNorm."""


def wrap(model: Any, options: LoraOptions, *, seed: int) -> Any:
    """`model` with fresh LoRA adapters (B = 0, so the wrapped model starts equal to the base)."""
    try:
        import peft
    except ImportError as exc:
        raise AstraflowError(
            "LoRA needs the peft package", hint="pip install 'astraflow[lora]' (or pip install peft)"
        ) from exc
    import torch

    config = peft.LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,  # type: ignore[arg-type]
        lora_dropout=options.dropout,
        target_modules=options.target_modules,
        bias="none",
    )
    # The adapters' A matrices are random: seed them so a run is reproducible from its recipe.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, config)
        except ValueError as exc:
            raise AstraflowError(
                f"cannot add LoRA adapters: {exc}", hint="check trainer_options.lora.target_modules"
            ) from exc
    for fragment in options.also_train:
        hits = [p for name, p in wrapped.named_parameters() if fragment in name and ".lora_" not in name]
        if not hits:
            raise AstraflowError(
                f"lora.also_train: no parameter name contains {fragment!r}", hint='e.g. also_train = ["norm"]'
            )
        for p in hits:
            p.requires_grad_(True)
    return wrapped


def merged_state_dict(model: Any) -> dict[str, Any]:
    """Dense weights of a peft-wrapped causal LM under the base model's names: name -> CPU tensor."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, Any] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer: Any = module
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    d = layer.get_delta_weight(adapter).detach()
                    key = f"{name}.weight"
                    deltas[key] = deltas[key] + d if key in deltas else d
    out: dict[str, Any] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        v = value.detach()
        if clean in deltas:
            v = (v.float() + deltas[clean].float()).to(v.dtype)
        out[clean] = v.to("cpu", copy=True)
    return out

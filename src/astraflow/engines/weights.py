"""Checks on weights offered to an engine, before anything is copied: every name must be one of the
model's parameters, with the same shape, and a dtype the parameter can take without losing its kind
(any floating dtype for a floating parameter, which is cast on copy; otherwise the same dtype).

An engine whose parameters are not the checkpoint's (vLLM fuses q/k/v; an SGLang server is another
process) checks against `checkpoint_meta`: the checkpoint's names, shapes and dtypes as meta tensors,
read from its safetensors headers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from astraflow.errors import WeightsMismatchError


def check_weights(
    params: Mapping[str, torch.Tensor], state_dict: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The offered weights as tensors, or WeightsMismatchError listing what does not fit."""
    problems: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        param = params.get(name)
        if param is None:
            problems.append(f"{name}: not a parameter of the model")
            continue
        try:
            t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            problems.append(f"{name}: not a tensor ({type(value).__name__}: {exc})")
            continue
        if tuple(t.shape) != tuple(param.shape):
            problems.append(f"{name}: shape {tuple(t.shape)}, the model has {tuple(param.shape)}")
        elif param.is_floating_point() != t.is_floating_point() or (
            not param.is_floating_point() and t.dtype != param.dtype
        ):
            problems.append(f"{name}: dtype {t.dtype}, the model has {param.dtype}")
        else:
            tensors[name] = t
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsMismatchError(
            f"{len(problems)} of {len(state_dict)} offered tensors do not fit the engine's model: "
            + "; ".join(problems[:5])
            + more,
            hint="the trainer and the rollout engine must load the same architecture and size",
        )
    return tensors


def checkpoint_meta(model_dir: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint's tensors as meta tensors (names, shapes, dtypes from the safetensors headers; no
    bytes), plus the tied output embedding that a trainer's state dict also names; None when
    `model_dir` is not a local directory of safetensors files."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                sl = st.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is not None:
                    out[name] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    config = model_dir / "config.json"
    tied = config.exists() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
    embed = out.get("model.embed_tokens.weight")
    if tied and embed is not None and "lm_head.weight" not in out:
        out["lm_head.weight"] = embed
    return out


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names."""

"""Checks on weights offered to an engine, before anything is copied: every name must be one of the
model's parameters, with the same shape, and a dtype the parameter can take without losing its kind
(any floating dtype for a floating parameter, which is cast on copy; otherwise the same dtype)."""

from __future__ import annotations

from collections.abc import Mapping
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

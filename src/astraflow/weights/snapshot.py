"""Full weight snapshots as bytes: safetensors in, safetensors out, never pickle."""

from __future__ import annotations

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save


def state_dict_to_bytes(sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialize a state_dict (any device, tied weights allowed) to safetensors bytes."""
    seen: set[tuple[int, int | torch.SymInt, int]] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied embeddings); give each its own copy
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()))
        flat[name] = t
    return _st_save(flat, metadata={"format": "pt", **(metadata or {})})


def bytes_to_state_dict(blob: bytes) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes into CPU tensors."""
    return _st_load(blob)

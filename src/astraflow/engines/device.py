"""Device choice shared by the embedded engine and the PyTorch trainer, and the engine's small
host-to-device transfers."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def resolve_device(device: str = "auto") -> str:
    """'auto' means CUDA when a GPU is visible, else CPU; ASTRAFLOW_DEVICE overrides 'auto'."""
    if device != "auto":
        return device
    env = os.environ.get("ASTRAFLOW_DEVICE")
    if env:
        return env
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, queued behind the stream's work without waiting for it.

    On a GPU it goes through pinned memory (torch's caching host allocator, which keeps a block until
    the copy that reads it has run): a copy from pageable memory may wait for the stream to drain,
    which would stall the host behind a decode step it meant to overlap."""
    if device.type != "cuda" or t.numel() == 0:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

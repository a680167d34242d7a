"""Device choice shared by the embedded engine and the PyTorch trainer."""

from __future__ import annotations

import os


def resolve_device(device: str = "auto") -> str:
    """'auto' means CUDA when a GPU is visible, else CPU; ASTRAFLOW_DEVICE overrides 'auto'."""
    if device != "auto":
        return device
    env = os.environ.get("ASTRAFLOW_DEVICE")
    if env:
        return env
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

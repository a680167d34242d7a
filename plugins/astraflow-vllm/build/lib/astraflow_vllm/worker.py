"""Runs inside vLLM's worker: reloads the model's weights in place from safetensors bytes.

vLLM mixes this class into its worker (`worker_extension_cls`), and the engine calls its methods
through `collective_rpc`. Tensors do not cross that call, bytes do; so the payload travels as one
safetensors blob and is decoded on the worker's side.
"""

from __future__ import annotations

from typing import Any


class WeightReloadExtension:
    """Worker methods astraflow calls by name through `collective_rpc`."""

    def astraflow_reload_weights(self, blob: bytes) -> int:
        """Load the tensors of a safetensors blob into the running model, in place; returns their count."""
        from safetensors.torch import load

        tensors = load(blob)
        worker: Any = self  # the vLLM worker this class is mixed into
        # vLLM's in-place reload maps checkpoint names (q/k/v, gate/up) onto its fused parameters.
        worker.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

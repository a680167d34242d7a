"""Runs inside vLLM's worker: loads new weights in place through vLLM's own reload path.

vLLM mixes this class into its worker (`worker_extension_cls`), and the engine calls its methods
through `collective_rpc`. Two ways in:

- `astraflow_load_slot`: only a reference to a same-host slot crosses the call (weights/slot_ref.py, a
  few KiB of msgpack); the worker maps the slot itself (the /dev/shm file on a CPU; on a GPU the
  trainer's device buffer, opened from its CUDA IPC handle with torch's own rebuild function), checks
  the version, layout and digest, and reloads from views of it: no copy before vLLM's own;
- `astraflow_reload_weights`: the tensors travel as one safetensors blob (tensors do not cross the
  call, bytes do), for versions that came by another path.
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

    def astraflow_load_slot(self, raw: bytes) -> str:
        """Map the referenced slot, check it and reload the model from it in place; "" when loaded, else
        why nothing was loaded (the old weights stay: every check runs before the first copy)."""
        from astraflow.errors import WeightIntegrityError
        from astraflow.weights.slot_ref import SlotRef, read_slot

        worker: Any = self
        try:
            ref = SlotRef.decode(raw)
            got = read_slot(ref, self._astraflow_importer())
        except (WeightIntegrityError, OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            worker.reload_weights(weights_iterator=iter(got.tensors.items()))
        finally:
            got.release()
        return ""

    def _astraflow_importer(self) -> Any:
        """This worker's slot importer (it keeps each slot mapped once), on the worker's device."""
        import torch

        from astraflow.weights.shared_buffer import SharedImporter

        importer = getattr(self, "_astraflow_slots", None)
        if importer is None:
            device = getattr(self, "device", None)
            if not (isinstance(device, torch.device) and device.type == "cuda"):
                device = torch.device("cpu")
            importer = SharedImporter(device)
            self._astraflow_slots = importer
        return importer

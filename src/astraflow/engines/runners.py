"""How the engine's decode loop runs the model: prefill prompts into slots, decode one token for the
rows in slots 0..n-1, and copy or move a slot's KV.

- `CachedRunner`: our Qwen3 forward over the preallocated slot KV cache; on a GPU, prefills (padded
  to a bucket shape, engines/prefill_graphs.py) and decode steps replay CUDA graphs, and decode steps
  run Triton kernels.
- `HFRecomputeRunner`: any other transformers causal LM. It keeps no KV cache and recomputes each
  row's whole sequence every step: correct for every architecture, and slow (quadratic in length).
"""

from __future__ import annotations

from typing import Any

import torch

from astraflow import log
from astraflow.engines.device import to_device

_log = log.get("engines.runners")


class CachedRunner:
    """Qwen3 over a SlotKVCache; CUDA graphs and Triton kernels on a GPU when asked for."""

    def __init__(self, model: Any, slots: int, max_len: int, *, graphs: bool, kernels: str) -> None:
        from astraflow.engines.ops import TorchOps
        from astraflow.engines.qwen3_forward import Qwen3Forward

        self.forward = Qwen3Forward(model, slots, max_len)
        self.device = self.forward.device
        on_gpu = self.device.type == "cuda"
        self.ops: Any = TorchOps
        self.uses_triton = False
        if on_gpu and kernels in ("auto", "triton"):
            try:
                from astraflow.engines.triton_ops import TritonOps

                self.ops, self.uses_triton = TritonOps, True
            except ImportError:
                if kernels == "triton":
                    raise
                _log.info("triton is not installed; decode steps use PyTorch ops")
        self.graphs = None
        self.prefill_graphs = None
        if on_gpu and graphs:
            from astraflow.engines.graphs import DecodeGraphs
            from astraflow.engines.prefill_graphs import PrefillGraphs

            self.graphs = DecodeGraphs(self.forward, self.ops, slots)
            self.prefill_graphs = PrefillGraphs(self.forward)
        self.pad_prefill = self.prefill_graphs is not None
        """Pad each prefill with a bucket to it. Only where a graph replays it by default: an eager
        prefill is compute-bound on a CPU, where padding made it 1.5 to 2.5 times slower; CPU tests
        turn it on to run the engine through the shapes the graphs replay."""

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Logits [n, V] at each prompt's last token; the prompts' KV lands in `slots`. A shape with a
        bucket is padded to it (`pad_prefill`), and replayed as a CUDA graph when graphs are on."""
        from astraflow.engines.prefill_graphs import bucket

        shape = None
        if self.pad_prefill:
            shape = bucket(len(prompts), max(len(p) for p in prompts), self.forward.cache.max_len)
        if shape is not None and self.prefill_graphs is not None:
            return self.prefill_graphs.run(prompts, slots, shape)
        return self.forward.prefill(prompts, slots, shape)

    def decode(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Logits [n, V] for rows 0..n-1, each feeding `tokens[i]` at `positions[i]`; `tokens` may be
        a tensor already on the device (the overlapped loop's), which is read there, not on the host."""
        if self.graphs is not None:
            return self.graphs.run(tokens, positions)
        t = tokens if isinstance(tokens, torch.Tensor) else to_device(torch.tensor(tokens), self.device)
        p = to_device(torch.tensor(positions), self.device)
        return self.forward.decode_step(t, p, p + 1, max(positions) + 1, self.ops)

    def copy_slot(self, src: int, dst: list[int], length: int) -> None:
        """Share a prompt's KV: copy slot src's first `length` positions into each slot of dst."""
        self.forward.cache.copy_slot(src, dst, length)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a sequence to another slot (compaction)."""
        self.forward.cache.move_slot(src, dst, length)


class HFRecomputeRunner:
    """Any transformers causal LM: each step runs the rows' whole sequences (no KV cache)."""

    def __init__(self, model: Any, slots: int) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.seqs: list[list[int]] = [[] for _ in range(slots)]
        pad = model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.uses_triton = False

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Logits [n, V] at each prompt's last token."""
        for p, s in zip(prompts, slots, strict=True):
            self.seqs[s] = list(p)
        return self._last_logits([self.seqs[s] for s in slots])

    def decode(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Logits [n, V] for rows 0..n-1 after appending tokens[i] at positions[i] (a device tensor
        of tokens is read back first: this runner builds its inputs on the host)."""
        if isinstance(tokens, torch.Tensor):
            tokens = [int(t) for t in tokens.tolist()]
        for i, (t, p) in enumerate(zip(tokens, positions, strict=True)):
            self.seqs[i] = [*self.seqs[i][:p], t]
        return self._last_logits(self.seqs[: len(tokens)])

    def copy_slot(self, src: int, dst: list[int], length: int) -> None:
        """Share a prompt: copy its first `length` tokens."""
        for d in dst:
            self.seqs[d] = self.seqs[src][:length]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a sequence to another slot."""
        self.seqs[dst] = self.seqs[src][:length]

    @torch.no_grad()
    def _last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        return out.logits[:, -1, :]

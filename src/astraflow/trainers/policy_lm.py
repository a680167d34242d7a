"""A causal LM seen as a policy: the backbone's hidden states, then chunked logprobs of trained tokens.

`PolicyLM` wraps a transformers causal LM (optionally inside a peft model) without copying it. Its
forward runs the decoder stack, picks the hidden states of trained positions only, and applies the
output embedding a chunk at a time (trainers/logprobs.py), so the [tokens x vocab] logits never exist
whole. Being one nn.Module, it is also the unit FSDP2 wraps at the root (the embedding, final norm
and output embedding, tied or not, live in the root's parameter group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from astraflow.errors import AstraflowError
from astraflow.trainers.logprobs import chunked_token_logprobs
from astraflow.trainers.packing import MicroBatch


def causal_lm(model: Any) -> Any:
    """The transformers causal LM inside `model` (unwraps a peft model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: Any) -> list[nn.Module]:
    """The transformer blocks of a causal LM (the per-layer units of sharding and checkpointing)."""
    lm = causal_lm(model)
    backbone = getattr(lm, lm.base_model_prefix)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise AstraflowError(
            f"{type(lm).__name__} has no `layers` list in its backbone",
            hint="the trainer supports decoder-only models laid out like Llama/Qwen",
        )
    return list(layers)


class PolicyLM(nn.Module):
    """Logprobs (with grad) and entropies (without) of a micro-batch's trained tokens."""

    def __init__(self, model: Any, *, chunk: int = 2048, fused: bool = False, recompute: bool = True) -> None:
        super().__init__()
        self.model = model
        lm = causal_lm(model)
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(lm.config, attr, None):
                raise AstraflowError(
                    f"{type(lm).__name__} transforms its logits ({attr}); the chunked logprobs do not",
                    hint="use a model whose logits are hidden states x output embedding",
                )
        self.chunk = chunk
        self.fused = fused
        self.recompute = recompute

    def hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        causal_only: bool = False,
    ) -> torch.Tensor:
        """Final hidden states [R, W, H] of the rows (after the backbone's last norm). `causal_only`: the
        caller knows plain causal attention is exact (one sequence per row, padding after it)."""
        lm = causal_lm(self.model)
        backbone = getattr(lm, lm.base_model_prefix)
        mask: Any = attention_mask
        types = set(getattr(lm.config, "layer_types", None) or ["?"])
        if causal_only and types == {"full_attention"}:
            # A ready mask mapping with no mask: attention runs with is_causal, the fast fused kernels,
            # also inside a compiled graph (where transformers would otherwise build a dense mask).
            mask = {"full_attention": None}
        out = backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
        return out.last_hidden_state

    def forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, entropy) as [B, L] views (zero where not trained)."""
        h = self.hidden(mb.input_ids, mb.position_ids, mb.attention_mask, causal_only=mb.one_per_row)
        flat = h.reshape(-1, h.shape[-1])
        weight = causal_lm(self.model).get_output_embeddings().weight
        logp, ent = chunked_token_logprobs(
            flat.index_select(0, mb.src),
            weight,
            mb.targets,
            mb.temperature,
            mb.top_p,
            mb.top_k,
            chunk=self.chunk,
            fused=self.fused,
            filtered=mb.filtered,
            recompute=self.recompute,
        )
        b, length = mb.view_shape
        if b == 0:
            # An empty filler still touches every parameter, so sharded collectives stay in step.
            zero = (h.sum() * 0.0).float() + logp.sum()
            return zero * torch.ones(1, 1, device=h.device), torch.zeros(1, 1, device=h.device)
        # Fresh [B, L] tensors (not views): FSDP hooks its pre-backward onto the outputs.
        at = (mb.dst // length, mb.dst % length)
        lp_view = torch.zeros(b, length, dtype=torch.float32, device=h.device).index_put(at, logp)
        ent_view = torch.zeros(b, length, dtype=torch.float32, device=h.device).index_put(at, ent)
        return lp_view, ent_view

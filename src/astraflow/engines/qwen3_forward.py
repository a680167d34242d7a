"""Our own forward of the Qwen3 decoder over the slot KV cache, reading the HF model's weights.

The HF model stays loaded (the bench and the trainer-side checks use it), but its q/k/v and gate/up
projection weights are re-pointed into fused buffers, one [q; k; v] and one [gate; up] matrix per
layer, so a decode step runs one matmul where HF runs three (or two). Weight updates that copy_ into
the HF parameters therefore land in the fused buffers too, in place: CUDA graphs that captured them
stay valid.

Two entry points: `prefill` (right-padded prompts, causal attention, writes the KV of given slots and
returns the logits at each prompt's last position; its body `prefill_packed`, over inputs already on
the device, is what the runner's prefill graphs capture) and `decode_step` (one token for each of
the rows in slots 0..B-1, through an ops table: plain PyTorch or Triton kernels).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from astraflow.engines.device import to_device
from astraflow.engines.kv_cache import SlotKVCache
from astraflow.engines.ops import TorchOps, rmsnorm, rope, silu_mul


def supports(model: Any) -> bool:
    """True for the Qwen3 dense decoder this forward implements (no biases, no sliding window)."""
    cfg = model.config
    return (
        getattr(cfg, "model_type", "") == "qwen3"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "use_sliding_window", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and hasattr(getattr(model, "model", None), "rotary_emb")
    )


class Qwen3Forward:
    """Prefill and decode steps of a transformers Qwen3ForCausalLM over a SlotKVCache."""

    def __init__(self, model: Any, slots: int, max_len: int) -> None:
        cfg = model.config
        inner = model.model
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = float(cfg.rms_norm_eps)
        self.vocab = cfg.vocab_size
        weight = inner.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv = _fuse([att.q_proj, att.k_proj, att.v_proj])
                gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
                self.layers.append(
                    (
                        layer.input_layernorm.weight,
                        qkv,
                        att.q_norm.weight,
                        att.k_norm.weight,
                        att.o_proj.weight,
                        layer.post_attention_layernorm.weight,
                        gate_up,
                        mlp.down_proj.weight,
                    )
                )
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.cache = SlotKVCache(
            len(self.layers), slots, self.kv_heads, max_len, self.head_dim, self.dtype, self.device
        )
        # Rotary tables for every position the cache holds, computed as HF does (float32, then cast).
        rot = inner.rotary_emb
        pos = torch.arange(max_len + 1, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * rot.inv_freq.float().to(self.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(rot, "attention_scaling", 1.0))
        self.cos = (emb.cos() * scale).to(self.dtype)
        self.sin = (emb.sin() * scale).to(self.dtype)

    def pack_prefill(
        self, prompts: list[list[int]], slots: list[int], shape: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The host inputs of a prefill as one int64 tensor [rows * width + 2 * rows]: token ids
        (right-padded with 0), then each row's slot, then its last token's index. `shape` (rows, width)
        pads to a bucket: rows beyond the prompts are padding prompts, of slot `cache.scratch_slot`
        and last index 0; None means (number of prompts, longest prompt)."""
        n = len(prompts)
        rows, width = shape or (n, max(len(p) for p in prompts))
        packed = torch.zeros(rows * width + 2 * rows, dtype=torch.long)
        ids = packed[: rows * width].view(rows, width)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        tail = packed[rows * width :].view(2, rows)
        tail[0, :n] = torch.tensor(slots, dtype=torch.long)
        tail[0, n:] = self.cache.scratch_slot
        tail[1, :n] = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
        return packed

    @torch.no_grad()
    def prefill(
        self, prompts: list[list[int]], slots: list[int], shape: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Run the prompts (right-padded), store their KV in `slots`; logits [n, V] at each last token.
        `shape` pads to a bucket as `pack_prefill` says (the padding rows' logits are dropped)."""
        rows, width = shape or (len(prompts), max(len(p) for p in prompts))
        packed = to_device(self.pack_prefill(prompts, slots, (rows, width)), self.device)
        return self.prefill_packed(packed, rows, width)[: len(prompts)]

    @torch.no_grad()
    def prefill_packed(self, packed: torch.Tensor, n: int, width: int) -> torch.Tensor:
        """The prefill forward of `pack_prefill`'s inputs, already on the device; logits [n, V].

        It reads nothing from the host and builds no host tensor, so a CUDA graph can capture it. Each
        row writes its KV at positions 0..width-1 of its slot, the positions beyond its prompt too:
        those hold garbage (keys of the padding tokens), which is harmless because decode writes
        position `length` before it attends to it and attends only to positions below `lengths`, and
        a shared prompt is copied to other slots only up to its length. Padding prompts write into
        the scratch slot (several of them into the same one: whichever lands last is never read).
        Attention is causal, so a prompt's own positions never see the padding after them."""
        ids = packed[: n * width].view(n, width)
        slot_idx = packed[n * width : n * width + n]
        last = packed[n * width + n :]
        cos = self.cos[:width][None, :, None, :]
        sin = self.sin[:width][None, :, None, :]
        h_, hk, d = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        res: torch.Tensor | None = None
        for i, (ln1, qkv_w, qn, kn, o_w, ln2, gu_w, down_w) in enumerate(self.layers):
            h, res = rmsnorm(x, ln1, self.eps, res)
            qkv = F.linear(h, qkv_w)
            q = qkv[..., : h_ * d].view(n, width, h_, d)
            k = qkv[..., h_ * d : (h_ + hk) * d].view(n, width, hk, d)
            v = qkv[..., (h_ + hk) * d :].view(n, width, hk, d)
            q = rope(rmsnorm(q, qn, self.eps)[0], cos, sin).transpose(1, 2)
            k = rope(rmsnorm(k, kn, self.eps)[0], cos, sin).transpose(1, 2)
            v = v.transpose(1, 2)
            self.cache.k[i, :, :, :width].index_copy_(0, slot_idx, k)
            self.cache.v[i, :, :, :width].index_copy_(0, slot_idx, v)
            if hk != h_:
                # each KV head repeated for its query heads by a plain copy, which a CUDA graph can
                # capture; SDPA's `enable_gqa` takes a repeat of its own on some backends (float32 on
                # a GPU), whose capture this code has not verified
                k = k[:, :, None].expand(n, hk, h_ // hk, width, d).reshape(n, h_, width, d)
                v = v[:, :, None].expand(n, hk, h_ // hk, width, d).reshape(n, h_, width, d)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = F.linear(att.transpose(1, 2).reshape(n, width, h_ * d), o_w)
            h, res = rmsnorm(a, ln2, self.eps, res)
            x = F.linear(silu_mul(F.linear(h, gu_w)), down_w)
        flat = torch.arange(n, device=packed.device) * width + last
        hidden = x.shape[-1]
        r = None if res is None else res.reshape(n * width, hidden)[flat]
        h, _ = rmsnorm(x.reshape(n * width, hidden)[flat], self.norm, self.eps, r)
        return F.linear(h, self.lm_head)

    @torch.no_grad()
    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        span: int,
        ops: Any = TorchOps,
    ) -> torch.Tensor:
        """One token for each row of slots 0..B-1: write its KV at `positions`, attend to the first
        `lengths` positions (at most `span`); logits [B, V]."""
        cos, sin = self.cos[positions], self.sin[positions]
        x = F.embedding(tokens, self.embed)
        res: torch.Tensor | None = None
        kc, vc = self.cache.k, self.cache.v
        for i, (ln1, qkv_w, qn, kn, o_w, ln2, gu_w, down_w) in enumerate(self.layers):
            h, res = ops.rmsnorm(x, ln1, self.eps, res)
            q = ops.qk_norm_rope_write(
                F.linear(h, qkv_w),
                qn,
                kn,
                cos,
                sin,
                positions,
                kc[i],
                vc[i],
                self.eps,
                self.heads,
                self.kv_heads,
            )
            a = F.linear(ops.decode_attention(q, kc[i], vc[i], lengths, span), o_w)
            h, res = ops.rmsnorm(a, ln2, self.eps, res)
            x = F.linear(ops.silu_mul(F.linear(h, gu_w)), down_w)
        h, _ = ops.rmsnorm(x, self.norm, self.eps, res)
        return F.linear(h, self.lm_head)


def _fuse(linears: list[Any]) -> torch.Tensor:
    """Concatenate the linears' weights (by output rows) into one buffer and re-point each weight at
    its slice, so later in-place updates of the HF parameters write into the fused buffer."""
    fused = torch.cat([m.weight.data for m in linears], dim=0)
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[start : start + rows]
        start += rows
    return fused

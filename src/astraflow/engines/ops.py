"""The decoder's building blocks in plain PyTorch: the reference the Triton kernels must match, and the
path every CPU run takes.

Each op rounds where transformers' Qwen3 rounds (norms computed in float32, then cast back to the
activation dtype before the weight multiplies), so in float32 the engine's logits equal the HF model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x); without a residual, (norm(x) * weight, x)."""
    if residual is not None:
        x = residual + x
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), x


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention. x [..., D]; cos/sin [..., D] broadcastable."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope_write(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Split one decode step's fused qkv [B, (H + 2 Hkv) D], norm and rotate q and k, write k and v at
    `positions` of slots 0..B-1 of the layer's cache [S, Hkv, L, D]; return q [B, H, D].
    cos/sin [B, D] are the rotary tables at the rows' positions, in the activation dtype."""
    b = qkv.shape[0]
    d = q_weight.shape[0]
    q = qkv[:, : heads * d].view(b, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(b, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(b, kv_heads, d)
    q, _ = rmsnorm(q, q_weight, eps)
    k, _ = rmsnorm(k, k_weight, eps)
    q = rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
    k = rope(k, cos.unsqueeze(1), sin.unsqueeze(1))
    rows = torch.arange(b, device=qkv.device)
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v
    return q


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, span: int
) -> torch.Tensor:
    """Attention of one query per row over the first lengths[i] cached positions of slot i.

    q [B, H, D]; caches [S, Hkv, L, D]; only the first `span` positions (>= max(lengths)) are read.
    The query heads of one KV head are laid out as that head's queries (q viewed [B, Hkv, G, D]), so
    grouped-query attention needs no repeated keys or values. Returns [B, H * D].
    """
    b, h, d = q.shape
    kv_heads = k_cache.shape[1]
    k = k_cache[:b, :, :span]
    v = v_cache[:b, :, :span]
    mask = torch.arange(span, device=q.device).unsqueeze(0) < lengths.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.view(b, kv_heads, h // kv_heads, d), k, v, attn_mask=mask[:, None, None, :]
    )
    return out.reshape(b, h * d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up from the fused [B, 2I] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchOps:
    """The decode-step ops as plain PyTorch (CPU, and GPUs without Triton)."""

    rmsnorm = staticmethod(rmsnorm)
    qk_norm_rope_write = staticmethod(qk_norm_rope_write)
    decode_attention = staticmethod(decode_attention)
    silu_mul = staticmethod(silu_mul)

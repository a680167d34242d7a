"""Triton kernels for the decode step on a GPU: each fuses what PyTorch runs as several launches.

- `rmsnorm`: residual add and RMSNorm in one pass.
- `qk_norm_rope_write`: q/k RMSNorm, rotary embedding and the KV-cache write of one step.
- `decode_attention`: one query per row over that row's own cached length (no padding read, no
  repeated K/V: a program serves all query heads of one KV head).
- `silu_mul`: SwiGLU.
Same signatures and semantics as engines/ops.py (float32 inside, one rounding to the activation dtype
at the end, where PyTorch rounds after each op: results agree within bf16 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(X, R, W, OUT, RES_OUT, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * N + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + row * N + offs, mask=mask, other=0.0).to(tl.float32)).to(
            X.dtype.element_ty
        )
    tl.store(RES_OUT + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * N + offs, (y * w).to(OUT.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x) for x [B, N]."""
    b, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    _rmsnorm_kernel[(b,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        res_out,
        eps,
        N=n,
        BLOCK=triton.next_power_of_2(n),
        HAS_RES=residual is not None,
        num_warps=4,
    )
    return out, res_out


@triton.jit
def _qk_rope_kernel(
    QKV,
    QW,
    KW,
    COS,
    SIN,
    POS,
    QOUT,
    KC,
    VC,
    eps,
    stride_qkv,
    stride_rot,
    stride_cs,
    stride_ch,
    stride_cl,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    is_q = h < H
    col = h * D  # q heads, then k heads, in the fused row
    x1 = tl.load(QKV + b * stride_qkv + col + half).to(tl.float32)
    x2 = tl.load(QKV + b * stride_qkv + col + D // 2 + half).to(tl.float32)
    var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D
    r = tl.rsqrt(var + eps)
    w_ptr = tl.where(is_q, QW, KW)
    w1 = tl.load(w_ptr + half).to(tl.float32)
    w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
    y1 = (x1 * r).to(QOUT.dtype.element_ty).to(tl.float32) * w1
    y2 = (x2 * r).to(QOUT.dtype.element_ty).to(tl.float32) * w2
    y1 = y1.to(QOUT.dtype.element_ty).to(tl.float32)
    y2 = y2.to(QOUT.dtype.element_ty).to(tl.float32)
    c = tl.load(COS + b * stride_rot + half).to(tl.float32)
    s = tl.load(SIN + b * stride_rot + half).to(tl.float32)
    o1 = (y1 * c - y2 * s).to(QOUT.dtype.element_ty)
    o2 = (y2 * c + y1 * s).to(QOUT.dtype.element_ty)
    if is_q:
        base = QOUT + (b * H + h) * D
        tl.store(base + half, o1)
        tl.store(base + D // 2 + half, o2)
    else:
        kh = h - H
        pos = tl.load(POS + b)
        cbase = b * stride_cs + kh * stride_ch + pos * stride_cl
        tl.store(KC + cbase + half, o1)
        tl.store(KC + cbase + D // 2 + half, o2)
        vcol = (H + HKV + kh) * D
        v1 = tl.load(QKV + b * stride_qkv + vcol + half)
        v2 = tl.load(QKV + b * stride_qkv + vcol + D // 2 + half)
        tl.store(VC + cbase + half, v1)
        tl.store(VC + cbase + D // 2 + half, v2)


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
    """See ops.qk_norm_rope_write."""
    b = qkv.shape[0]
    d = q_weight.shape[0]
    q = torch.empty((b, heads, d), dtype=qkv.dtype, device=qkv.device)
    _qk_rope_kernel[(b, heads + kv_heads)](
        qkv,
        q_weight,
        k_weight,
        cos,
        sin,
        positions,
        q,
        k_cache,
        v_cache,
        eps,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        H=heads,
        HKV=kv_heads,
        D=d,
        num_warps=1,
    )
    return q


@triton.jit
def _decode_attn_kernel(
    Q,
    KC,
    VC,
    LENS,
    OUT,
    sm_scale,
    stride_cs,
    stride_ch,
    stride_cl,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    length = tl.load(LENS + b)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    q_ptrs = Q + (b * H + kh * G + offs_g)[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptrs, mask=gmask[:, None], other=0.0)
    q = (q.to(tl.float32) * (sm_scale * 1.4426950408889634)).to(q.dtype)  # exp2 domain
    m = tl.full((GP,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    base = b * stride_cs + kh * stride_ch
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < length
        kv_off = base + offs_n[:, None] * stride_cl + offs_d[None, :]
        k = tl.load(KC + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(VC + kv_off, mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l_sum[:, None]
    o_ptrs = OUT + (b * H + kh * G + offs_g)[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=gmask[:, None])


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, span: int
) -> torch.Tensor:
    """See ops.decode_attention; reads exactly lengths[i] positions of each row (span is unused)."""
    b, h, d = q.shape
    kv_heads = k_cache.shape[1]
    g = h // kv_heads
    out = torch.empty_like(q)
    _decode_attn_kernel[(b, kv_heads)](
        q,
        k_cache,
        v_cache,
        lengths,
        out,
        d**-0.5,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        H=h,
        G=g,
        GP=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK_N=64,
        num_warps=4,
        num_stages=3,
    )
    return out.view(b, h * d)


@triton.jit
def _silu_mul_kernel(GU, OUT, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(GU + row * 2 * INTER + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * INTER + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * INTER + offs, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU from the fused [B, 2I] projection."""
    b, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((b, i), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(b, triton.cdiv(i, block))](gate_up, out, INTER=i, BLOCK=block, num_warps=4)
    return out


class TritonOps:
    """The decode-step ops as Triton kernels (CUDA only)."""

    rmsnorm = staticmethod(rmsnorm)
    qk_norm_rope_write = staticmethod(qk_norm_rope_write)
    decode_attention = staticmethod(decode_attention)
    silu_mul = staticmethod(silu_mul)

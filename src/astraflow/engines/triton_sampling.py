"""Triton kernels for sampling on a GPU: Gumbel-max over the tempered logits with the logprob of the
chosen token, in one pass over the vocabulary; and the same Gumbel noise on its own for rows that
need top-k / top-p (engines/sampler.py applies those through sampling.processed_logprobs).

The noise of row i at a step comes from Philox keyed by that row's step seed (derived from the
request's seed and the token index), so a seeded request samples the same tokens whatever its batch
mates, and the fused and the unfused path draw the same noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel(seed, offs):
    u = tl.rand(seed, offs)
    u = tl.maximum(u, 1e-20)
    return -tl.log(-tl.log(u))


@triton.jit
def _fused_sample_kernel(LOGITS, TEMP, SEEDS, TOK, LP, stride, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(TEMP + row)
    seed = tl.load(SEEDS + row)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.zeros((BLOCK,), tl.int32)
    best_x = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(LOGITS + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
        # Per-lane running logsumexp and Gumbel argmax; lanes are merged once at the end.
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.where(mask, tl.exp(x - m_new), 0.0)
        s = tl.where(m_new == float("-inf"), 0.0, s)
        m = m_new
        z = tl.where(mask, x + _gumbel(seed, offs), float("-inf"))
        better = z > best
        best = tl.where(better, z, best)
        best_i = tl.where(better, offs, best_i)
        best_x = tl.where(better, x, best_x)
    m_all = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - m_all), axis=0)
    top = tl.max(best, axis=0)
    # Lowest index among exact ties, for determinism.
    idx = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    x_at = tl.max(tl.where(best_i == idx, best_x, float("-inf")), axis=0)
    tl.store(TOK + row, idx)
    tl.store(LP + row, x_at - m_all - tl.log(total))


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int32, logprobs [B] float32) under softmax(logits / temperature); one read of logits."""
    b, v = logits.shape
    tok = torch.empty(b, dtype=torch.int32, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    _fused_sample_kernel[(b,)](
        logits, temperature, seeds, tok, lp, logits.stride(0), V=v, BLOCK=1024, num_warps=8
    )
    return tok, lp


@triton.jit
def _noise_kernel(SEEDS, OUT, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(SEEDS + row)
    tl.store(OUT + row * V + offs, _gumbel(seed, offs), mask=offs < V)


def gumbel_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [B, V] float32, the same that fused_sample adds for these seeds."""
    b = seeds.shape[0]
    out = torch.empty((b, vocab), dtype=torch.float32, device=seeds.device)
    block = 1024
    _noise_kernel[(b, triton.cdiv(vocab, block))](seeds, out, V=vocab, BLOCK=block, num_warps=4)
    return out

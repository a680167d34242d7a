"""Logprobs and entropy of chosen tokens without the vocabulary wall.

The trainer needs, for each trained token, its logprob under the *processed* sampling distribution of
its sequence (`engines.sampling.processed_logprobs`: temperature, top-k, top-p, per row) and the
entropy of that distribution. Materialising the fp32 logits of every token at once costs
tokens x vocab x 4 bytes (16k tokens x 152k vocabulary = 10 GB per copy), so here the hidden states
are multiplied by the output embedding a chunk of tokens at a time, in the forward pass and again in
the backward pass (recomputation), inside one autograd Function. Only [tokens] logprobs and entropies
and the [tokens x hidden] hidden states are kept between the passes.

Without recomputation (`recompute=False`, chunks without top-p/top-k only) the forward pass also writes
d logp / d logits = (onehot(target) - softmax) / temperature for every token, in the logits' dtype
([tokens x vocab] x 2 bytes in bf16), and the backward pass is two GEMMs with no pass over the
vocabulary: grad_h = g * (q @ W) and grad_W = q^T @ (g * h), the upstream gradient g applied to the
thin side.
"""

from __future__ import annotations

from typing import Any

import torch

from astraflow.engines.sampling import processed_logprobs


def _chunk_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
) -> torch.Tensor:
    """Processed log-probabilities [n, V] of one chunk of hidden states."""
    logits = h @ weight.t()
    return processed_logprobs(logits, temperature, top_p, top_k)


def _entropy(lp: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of log-probabilities (-inf entries, outside the nucleus, count zero)."""
    p = lp.exp()
    return -torch.where(torch.isfinite(lp), p * lp, torch.zeros_like(lp)).sum(-1)


def _unfiltered(top_p: torch.Tensor, top_k: torch.Tensor, vocab: int) -> bool:
    """Whether no row of a chunk uses top-p or top-k (the plain tempered softmax)."""
    return not bool(((top_p < 1.0) | ((top_k > 0) & (top_k < vocab))).any())


def _plain_stats(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) of `targets` under softmax(logits * inv_temp) (no top-p/top-k)."""
    x = logits.float() * inv_temp.unsqueeze(-1)
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    # H = lse - sum(softmax(x) * x)
    ent = lse - (torch.softmax(x, dim=-1) * x).sum(-1)
    return logp, ent


def _plain_grad(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """d(sum g * logp) / d logits = g * (onehot(target) - softmax(x)) / temperature, in logits' dtype."""
    gt = (g * inv_temp).unsqueeze(-1)
    gl = torch.softmax(logits.float() * inv_temp.unsqueeze(-1), dim=-1).mul_(-gt)
    gl.scatter_add_(-1, targets.unsqueeze(-1), gt)
    return gl.to(logits.dtype)


def _plain_grad_fusable(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """_plain_grad written without in-place ops, so torch.compile fuses it into few kernels."""
    x = logits.float() * inv_temp.unsqueeze(-1)
    onehot = torch.arange(x.shape[-1], device=x.device).unsqueeze(0) == targets.unsqueeze(-1)
    return ((onehot.float() - torch.softmax(x, dim=-1)) * (g * inv_temp).unsqueeze(-1)).to(logits.dtype)


def _plain_stats_and_factor(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, q) with q = d logp / d logits = (onehot(target) - softmax(x)) / temperature in
    logits' dtype: the whole gradient over the vocabulary, short of the upstream factor."""
    x = logits.float() * inv_temp.unsqueeze(-1)
    lp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    p = torch.exp(lp)
    logp = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # -sum(p * log p) term by term: lse - sum(p * x) would cancel two large numbers.
    ent = -(p * lp).sum(-1)
    onehot = torch.arange(x.shape[-1], device=x.device).unsqueeze(0) == targets.unsqueeze(-1)
    q = ((onehot.float() - p) * inv_temp.unsqueeze(-1)).to(logits.dtype)
    return logp, ent, q


def _plain_stats_into(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """_plain_stats_and_factor writing q into `out` (compiled: the kernel stores there, no extra copy)."""
    logp, ent, q = _plain_stats_and_factor(logits, targets, inv_temp)
    out.copy_(q)
    return logp, ent


_COMPILED: dict[str, Any] = {}


def _kernel(name: str, fused: bool) -> Any:
    """`_plain_stats` / `_plain_grad` / `_plain_stats_and_factor`, fused into a few kernels by
    torch.compile when `fused`."""
    if not fused:
        return {"stats": _plain_stats, "grad": _plain_grad, "factor": _plain_stats_into}[name]
    if name not in _COMPILED:
        fn: Any = {"stats": _plain_stats, "grad": _plain_grad_fusable, "factor": _plain_stats_into}[name]
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(logp [N], entropy [N]) of `targets` from hidden states [N, H] and output embedding [V, H].

    Forward and backward each visit the tokens `chunk` at a time, so the largest temporary is
    [chunk, V]. The gradient flows to the hidden states and the output embedding through logp only;
    the entropy is a metric (no gradient). Chunks without top-p/top-k take a closed form (softmax
    gradient) with fewer passes over the logits; others recompute through processed_logprobs.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        chunk: int,
        fused: bool,
        filtered: bool | None,
        recompute: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
        # Decided once per call (each check is a device sync, skipped when the caller knows), not per chunk.
        plain = not filtered if filtered is not None else _unfiltered(top_p, top_k, vocab)
        inv_temp = 1.0 / temperature
        stats = _kernel("stats", fused)
        keep = plain and not recompute and any(ctx.needs_input_grad[:2])
        factor: torch.Tensor | None = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            tgt = targets[s:e].unsqueeze(-1)
            if keep:
                logits = hidden[s:e] @ weight.t()
                if factor is None:
                    factor = torch.empty(n, vocab, dtype=logits.dtype, device=logits.device)
                logp[s:e], ent[s:e] = _kernel("factor", fused)(
                    logits, targets[s:e], inv_temp[s:e], factor[s:e]
                )
                del logits
            elif plain:
                logp[s:e], ent[s:e] = stats(hidden[s:e] @ weight.t(), targets[s:e], inv_temp[s:e])
            else:
                lp = _chunk_logprobs(
                    hidden[s:e], weight, targets[s:e], temperature[s:e], top_p[s:e], top_k[s:e]
                )
                logp[s:e] = lp.gather(-1, tgt).squeeze(-1)
                ent[s:e] = _entropy(lp)
                del lp
        ctx.save_for_backward(hidden, weight, targets, temperature, top_p, top_k)
        ctx.chunk, ctx.plain, ctx.fused = chunk, plain, fused
        ctx.factor = factor
        # The backward pass recomputes the logits: under the same autocast as this forward pass.
        dev = hidden.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_ent: torch.Tensor | None) -> Any:
        hidden, weight, targets, temperature, top_p, top_k = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # Accumulate the output embedding's gradient in fp32 across chunks, cast once at the end.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = hidden.shape[0]
        dev, enabled, dtype = ctx.autocast
        if ctx.factor is not None:
            q, ctx.factor = ctx.factor, None
            g = grad_logp.unsqueeze(-1)
            with torch.autocast(dev, dtype=dtype, enabled=enabled):
                w = weight.detach().to(q.dtype)
                gh = (q @ w).float().mul_(g).to(hidden.dtype) if need_h else None
                gw = (q.t() @ (hidden.detach().float() * g).to(q.dtype)).to(weight.dtype) if need_w else None
            return gh, gw, None, None, None, None, None, None, None, None
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            g = grad_logp[s:e]
            h = hidden[s:e].detach()
            with torch.autocast(dev, dtype=dtype, enabled=enabled):
                if ctx.plain:
                    # d logp / d logits = (onehot(target) - softmax(x)) / temperature
                    logits = h @ weight.t()
                    gl = _kernel("grad", ctx.fused)(logits, targets[s:e], 1.0 / temperature[s:e], g)
                    if need_h:
                        assert grad_h is not None
                        grad_h[s:e] = (gl @ weight.to(gl.dtype)).to(grad_h.dtype)
                    if need_w:
                        assert grad_w is not None
                        grad_w += (gl.t() @ h.to(gl.dtype)).float()
                    continue
                with torch.enable_grad():
                    hh = h.requires_grad_(need_h)
                    w = weight.detach().requires_grad_(need_w)
                    lp = _chunk_logprobs(hh, w, targets[s:e], temperature[s:e], top_p[s:e], top_k[s:e])
                    picked = lp.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
                    inputs = [t for t, need in ((hh, need_h), (w, need_w)) if need]
                    grads = iter(torch.autograd.grad(picked, inputs, g))
            if need_h:
                assert grad_h is not None
                grad_h[s:e] = next(grads)
            if need_w:
                assert grad_w is not None
                grad_w += next(grads).float()
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, gw, None, None, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    *,
    chunk: int = 2048,
    fused: bool = False,
    filtered: bool | None = None,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each [N] float32, of `targets` [N] given hidden states [N, H] and the output
    embedding [V, H], under each token's processed sampling distribution (settings [N]); `fused`
    compiles the element-wise work over the vocabulary (torch.compile) for chunks without filters;
    `filtered` says whether any token uses top-p/top-k (None = check, one device sync); with
    `recompute` False and no filters the backward pass reuses a [N, V] factor kept from the forward."""
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32) + 0 * weight.sum()
        return z, z.detach()
    out = ChunkedTokenLogprobs.apply(
        hidden, weight, targets, temperature, top_p, top_k, max(1, chunk), fused, filtered, recompute
    )
    return out[0], out[1]


def full_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as chunked_token_logprobs with every logit materialised at once (the reference)."""
    lp = _chunk_logprobs(hidden, weight, targets, temperature, top_p, top_k)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), _entropy(lp).detach()

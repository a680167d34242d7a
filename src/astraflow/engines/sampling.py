"""The sampling distribution, as one function that the engine samples from and the trainer recomputes.

Behaviour logprobs are taken under the *processed* distribution: logits / temperature, then top-k, then
top-p (nucleus), renormalised. The trainer must recompute logprobs under exactly the same processing,
or the on-policy ratio exp(logp_theta - logp_behaviour) is not 1 (with top_p < 1 it would be the
nucleus mass instead). Both sides call `processed_logprobs` so they cannot drift apart.
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    top_p: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int = 0,
) -> torch.Tensor:
    """Log-probabilities [N, V] of the processed distribution; -inf outside top-k / the nucleus.

    logits [N, V] (any float dtype; computed in float32); temperature, top_p, top_k scalars or [N].
    top_k 0 (or >= V) and top_p 1.0 turn that filter off. The nucleus is the smallest prefix of the
    tokens sorted by probability whose mass reaches top_p; the most likely token is always kept.
    """
    x = logits.float()
    n, v = x.shape
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=x.device).reshape(-1, 1)
    x = x / temp
    tk = torch.as_tensor(top_k, device=x.device).reshape(-1)
    tp = torch.as_tensor(top_p, dtype=torch.float32, device=x.device).reshape(-1)
    use_k = bool(((tk > 0) & (tk < v)).any())
    use_p = bool((tp < 1.0).any())
    if not (use_k or use_p):
        return torch.log_softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if use_k:
        k = torch.where((tk > 0) & (tk < v), tk, torch.full_like(tk, v)).expand(n).reshape(-1, 1)
        keep &= torch.arange(v, device=x.device).unsqueeze(0) < k
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
    if use_p:
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < tp.expand(n).reshape(-1, 1)
    keep[:, 0] = True
    sorted_logp = torch.log_softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.empty_like(sorted_logp).scatter_(-1, order, sorted_logp)

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
    *,
    filter_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities [N, V] of the processed distribution; -inf outside top-k / the nucleus.

    logits [N, V] (any float dtype; computed in float32); temperature, top_p, top_k scalars or [N].
    top_k 0 (or >= V) and top_p 1.0 turn that filter off. The nucleus is the smallest prefix of the
    tokens sorted by probability whose mass reaches top_p; the most likely token is always kept.
    Filters apply per row: a row that uses neither is exactly its own log_softmax(logits / temperature)
    whatever its batch mates use, and a filtered row is cut by its own top-p / top-k only.
    `filter_rows`: the indices of the rows that use top-k or top-p, when the caller knows them already
    (the engine's sampler does): finding them here reads a device value back, a wait for the device.
    """
    x = logits.float()
    n, v = x.shape
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=x.device).reshape(-1, 1)
    x = x / temp
    tk = torch.as_tensor(top_k, device=x.device).reshape(-1).expand(n)
    tp = torch.as_tensor(top_p, dtype=torch.float32, device=x.device).reshape(-1).expand(n)
    use_k = (tk > 0) & (tk < v)
    use_p = tp < 1.0
    rows = torch.nonzero(use_k | use_p).squeeze(-1) if filter_rows is None else filter_rows
    if rows.numel() == 0:
        return torch.log_softmax(x, dim=-1)
    sorted_x, order = torch.sort(x.index_select(0, rows), dim=-1, descending=True)
    pos = torch.arange(v, device=x.device).unsqueeze(0)
    k = torch.where(use_k, tk, torch.full_like(tk, v)).index_select(0, rows).unsqueeze(-1)
    keep = pos < k
    sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # a row without top-p keeps its whole top-k: a float32 cumsum can reach 1.0 before the tail ends
    p_off = ~use_p.index_select(0, rows).unsqueeze(-1)
    keep &= (mass_before < tp.index_select(0, rows).unsqueeze(-1)) | p_off
    keep[:, 0] = True
    sorted_logp = torch.log_softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    filtered = torch.empty_like(sorted_logp).scatter_(-1, order, sorted_logp)
    if rows.numel() == n:
        return filtered
    return torch.log_softmax(x, dim=-1).index_copy(0, rows, filtered)

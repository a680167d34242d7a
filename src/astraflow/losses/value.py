"""PPO's value side: per-token GAE from a value model's predictions, whitening, the clipped value loss.

An episode's reward is its only reward and comes at the sequence's last trained token. GAE runs over
trained tokens only: tokens the policy did not write (a prompt, a tool result between two turns) are
skipped, so the step after a turn's last token is the next turn's first token. With values V_k at the
trained tokens k = 1..n of a sequence (V_{n+1} = 0) and reward R:

    delta_k = r_k + gamma * V_{k+1} - V_k      (r_n = R, r_k = 0 before)
    A_k     = delta_k + gamma * lam * A_{k+1}  (A_{n+1} = 0)
    return_k = A_k + V_k                        (the value model's target)

Imports torch inside functions only, like every objective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and zero off the mask, from values [B, T], rewards [B] and the
    trained-token mask [B, T]; a row without trained tokens gets zeros."""
    import torch

    with torch.no_grad():
        v = values.detach().float()
        on = mask > 0
        b, t = v.shape
        adv = torch.zeros_like(v)
        next_value = torch.zeros(b, dtype=v.dtype, device=v.device)
        carry = torch.zeros_like(next_value)
        later = torch.zeros(b, dtype=torch.bool, device=v.device)  # a trained token follows
        r = rewards.detach().to(v.dtype)
        for k in range(t - 1, -1, -1):
            here = on[:, k]
            reward = torch.where(later, torch.zeros_like(r), r)
            a = reward + gamma * next_value - v[:, k] + gamma * lam * carry
            adv[:, k] = torch.where(here, a, torch.zeros_like(a))
            carry = torch.where(here, a, carry)
            next_value = torch.where(here, v[:, k], next_value)
            later = later | here
        returns = torch.where(on, adv + v, torch.zeros_like(v))
    return adv, returns


def whiten(adv: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Per-token advantages of several micro-batches shifted and scaled to mean 0, std 1 over all their
    trained tokens together (population std; all zeros when the std is 0)."""
    import torch

    with torch.no_grad():
        flat = torch.cat([a[m > 0] for a, m in zip(adv, masks, strict=True)])
        if flat.numel() == 0:
            return [torch.zeros_like(a) for a in adv]
        mean = flat.double().mean()
        std = flat.double().std(unbiased=False)
        if float(std) == 0.0:
            return [torch.zeros_like(a) for a in adv]
        return [
            torch.where(m > 0, ((a.double() - mean) / (std + eps)).to(a.dtype), torch.zeros_like(a))
            for a, m in zip(adv, masks, strict=True)
        ]


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    total_tokens: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * sum over trained tokens of max((V - R)^2, (V_clip - R)^2) / total_tokens, where
    V_clip = V_old + clamp(V - V_old, -clip, clip): a prediction gains nothing by moving further than
    `clip` from the one taken before the step. Metrics: value_clip_frac (tokens where the clipped
    branch is the larger), value_mean."""
    import torch

    old = old_values.detach()
    target = returns.detach()
    v_clip = old + torch.clamp(values - old, -clip, clip)
    plain = (values - target) ** 2
    clipped = (v_clip - target) ** 2
    on = mask > 0
    loss = 0.5 * (torch.maximum(plain, clipped) * mask).sum() / max(float(total_tokens), 1.0)
    with torch.no_grad():
        n = on.sum().clamp(min=1)
        metrics = {
            "value_clip_frac": float(((clipped > plain) & on).sum() / n),
            "value_mean": float((values.detach() * mask).sum() / n),
        }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over trained tokens (1 = the values predict the returns; 0 for constant returns)."""
    import torch

    with torch.no_grad():
        on = mask > 0
        r = returns[on].double()
        if r.numel() < 2:
            return 0.0
        var = r.var(unbiased=False)
        if float(var) == 0.0:
            return 0.0
        return float(1.0 - (r - values[on].double()).var(unbiased=False) / var)

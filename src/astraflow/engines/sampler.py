"""Sampling for the embedded engine: Gumbel-max over sampling.processed_logprobs, with the logprob of
the chosen token, and noise that depends only on (row seed, token index).

argmax(logp + Gumbel noise) draws exactly from softmax(logp), so the token is a sample of the processed
distribution (temperature -> top-k -> top-p) and its logprob is read off the same logp the trainer
recomputes. On a GPU with Triton, rows that use neither top-k nor top-p take one fused kernel
(engines/triton_sampling.py); every other case computes processed_logprobs in PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch

from astraflow.engines.sampling import processed_logprobs

_MASK = (1 << 62) - 1


def step_seeds(seeds: list[int], counters: list[int]) -> torch.Tensor:
    """A Philox key per row for its next token: a mix of the row's seed and its token index."""
    return torch.tensor(
        [(s * 0x9E3779B1 + c * 0x85EBCA77 + 1) & _MASK for s, c in zip(seeds, counters, strict=True)]
    )


class Sampler:
    """Draws one token per row; GPU rows use Philox noise, CPU rows a torch.Generator per row."""

    def __init__(self, device: torch.device, use_triton: bool) -> None:
        self.device = device
        self.use_triton = use_triton and device.type == "cuda"

    def sample(
        self,
        logits: torch.Tensor,
        temperature: list[float],
        top_p: list[float],
        top_k: list[int],
        seeds: list[int],
        counters: list[int],
        generators: list[Any],
    ) -> tuple[list[int], list[float]]:
        """Tokens and their logprobs under the processed distribution, for rows of logits [n, V]."""
        n, vocab = logits.shape
        temp = torch.tensor(temperature, dtype=torch.float32).to(self.device, non_blocking=True)
        plain = all(p >= 1.0 for p in top_p) and all(k <= 0 or k >= vocab for k in top_k)
        if self.use_triton:
            from astraflow.engines import triton_sampling

            key = step_seeds(seeds, counters).to(self.device, non_blocking=True)
            if plain:
                tok, lp = triton_sampling.fused_sample(logits, temp, key)
                return _to_lists(tok, lp)
            noise = triton_sampling.gumbel_noise(key, vocab)
        else:
            u = torch.stack([torch.rand(vocab, generator=g, device=self.device) for g in generators])
            noise = -torch.log(-torch.log(u.clamp_min(1e-20)))
        logp = processed_logprobs(
            logits,
            temp,
            torch.tensor(top_p, dtype=torch.float32, device=self.device),
            torch.tensor(top_k, device=self.device),
        )
        tok = (logp + noise).argmax(dim=-1)
        return _to_lists(tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1))


def _to_lists(tok: torch.Tensor, lp: torch.Tensor) -> tuple[list[int], list[float]]:
    """One device-to-host transfer for both."""
    both = torch.stack([tok.double(), lp.double()]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()

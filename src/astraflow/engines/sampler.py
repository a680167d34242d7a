"""Sampling for the embedded engine: Gumbel-max over sampling.processed_logprobs, with the logprob of
the chosen token, and noise that depends only on (row seed, token index).

argmax(logp + Gumbel noise) draws exactly from softmax(logp), so the token is a sample of the processed
distribution (temperature -> top-k -> top-p) and its logprob is read off the same logp the trainer
recomputes. On a GPU with Triton, rows that use neither top-k nor top-p take one fused kernel
(engines/triton_sampling.py), also in a batch mixed with filtered rows; every other row computes
processed_logprobs in PyTorch, which applies each row's own filters.
"""

from __future__ import annotations

from typing import Any

import torch

from astraflow.engines.sampling import processed_logprobs
from astraflow.protocol.messages import SamplingParams

_MASK = (1 << 62) - 1


def step_seeds(seeds: list[int], counters: list[int]) -> torch.Tensor:
    """A Philox key per row for its next token: a mix of the row's seed and its token index."""
    return torch.tensor(
        [(s * 0x9E3779B1 + c * 0x85EBCA77 + 1) & _MASK for s, c in zip(seeds, counters, strict=True)]
    )


_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 lanes holding values < 2**32; every
    product stays below 2**59, so nothing overflows."""
    h = ((h >> 16) ^ h) * 0x45D9F3B & _M32
    h = ((h >> 16) ^ h) * 0x45D9F3B & _M32
    return (h >> 16) ^ h


def hashed_gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [n, vocab] (float32, on the keys' device) that depends only on each row's key and
    the token id: the whole batch in a few tensor ops, where a generator per row costs a call per row
    and token."""
    keys = keys.to(torch.int64)
    row = _mix32((keys & _M32) ^ _mix32((keys >> 32) & _M32))
    col = torch.arange(vocab, dtype=torch.int64, device=keys.device) * 0x9E3779B1 & _M32
    h = _mix32(row[:, None] ^ col[None, :])
    u = (h.double() + 0.5) / 4294967296.0  # in (0, 1): -log(-log(u)) stays finite
    return (-torch.log(-torch.log(u))).float()


class Sampler:
    """Draws one token per row; GPU rows use Philox noise, CPU rows hashed noise (or a torch.Generator
    per row when the caller passes them)."""

    def __init__(self, device: torch.device, use_triton: bool) -> None:
        self.device = device
        self.use_triton = use_triton and device.type == "cuda"

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        counters: list[int],
        generators: list[Any],
    ) -> tuple[list[int], list[float]]:
        """Tokens and their logprobs under each row's processed distribution, for rows of logits [n, V].

        Each row is sampled under its own settings only: a row's token and logprob do not depend on
        the settings of the rows batched with it."""
        n, vocab = logits.shape
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(
            self.device, non_blocking=True
        )
        plain = [p.top_p >= 1.0 and (p.top_k <= 0 or p.top_k >= vocab) for p in params]
        if self.use_triton:
            from astraflow.engines import triton_sampling

            key = step_seeds(seeds, counters).to(self.device, non_blocking=True)
            if all(plain):
                tok, lp = triton_sampling.fused_sample(logits, temp, key)
                return _to_lists(tok, lp)
            if any(plain):
                # plain rows keep the fused kernel (the same numbers as in an all-plain batch)
                tokens, logps = [0] * n, [0.0] * n
                for rows, fn in ((_where(plain, True), self._fused), (_where(plain, False), self._filtered)):
                    idx = torch.tensor(rows, device=self.device)
                    sub = [params[i] for i in rows]
                    got = fn(
                        logits.index_select(0, idx), temp.index_select(0, idx), key.index_select(0, idx), sub
                    )
                    for i, a, b in zip(rows, *got, strict=True):
                        tokens[i], logps[i] = a, b
                return tokens, logps
            return self._filtered(logits, temp, key, params)
        if generators and all(g is not None for g in generators):
            u = torch.stack([torch.rand(vocab, generator=g, device=self.device) for g in generators])
            noise = -torch.log(-torch.log(u.clamp_min(1e-20)))
        else:
            noise = hashed_gumbel(step_seeds(seeds, counters).to(self.device), vocab)
        return self._pick(logits, temp, noise, params)

    def _fused(
        self, logits: torch.Tensor, temp: torch.Tensor, key: torch.Tensor, _params: list[SamplingParams]
    ) -> tuple[list[int], list[float]]:
        from astraflow.engines import triton_sampling

        return _to_lists(*triton_sampling.fused_sample(logits, temp, key))

    def _filtered(
        self, logits: torch.Tensor, temp: torch.Tensor, key: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], list[float]]:
        from astraflow.engines import triton_sampling

        return self._pick(logits, temp, triton_sampling.gumbel_noise(key, logits.shape[1]), params)

    def _pick(
        self, logits: torch.Tensor, temp: torch.Tensor, noise: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], list[float]]:
        """Gumbel-max over processed_logprobs (per-row filters), with the chosen token's logprob."""
        logp = processed_logprobs(
            logits,
            temp,
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
            torch.tensor([p.top_k for p in params], device=self.device),
        )
        tok = (logp + noise).argmax(dim=-1)
        return _to_lists(tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1))


def _where(flags: list[bool], value: bool) -> list[int]:
    """Indices of the rows whose flag is `value`."""
    return [i for i, f in enumerate(flags) if f is value]


def _to_lists(tok: torch.Tensor, lp: torch.Tensor) -> tuple[list[int], list[float]]:
    """One device-to-host transfer for both."""
    both = torch.stack([tok.double(), lp.double()]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()

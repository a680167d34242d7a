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

from astraflow.engines.device import to_device
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
        if not self.use_triton and generators and all(g is not None for g in generators):
            vocab = logits.shape[1]
            u = torch.stack([torch.rand(vocab, generator=g, device=self.device) for g in generators])
            noise = -torch.log(-torch.log(u.clamp_min(1e-20)))
            temp = to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), self.device)
            return to_lists(*self._pick(logits, temp, noise, params))
        return to_lists(*self.sample_on_device(logits, params, seeds, counters))

    def sample_on_device(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample` without reading the result back: tokens [n] int64 and logprobs [n] float32 on the
        device, queued behind the logits (nothing here waits for the device), noise from (seed, counter)."""
        n, vocab = logits.shape
        temp = to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), self.device)
        plain = [p.top_p >= 1.0 and (p.top_k <= 0 or p.top_k >= vocab) for p in params]
        keys = step_seeds(seeds, counters)
        if not self.use_triton:
            return self._pick(logits, temp, hashed_gumbel(to_device(keys, self.device), vocab), params)
        key = to_device(keys, self.device)
        if all(plain):
            return self._fused(logits, temp, key, params)
        if not any(plain):
            return self._filtered(logits, temp, key, params)
        # plain rows keep the fused kernel (the same numbers as in an all-plain batch)
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        logps = torch.empty(n, dtype=torch.float32, device=self.device)
        for rows, fn in ((_where(plain, True), self._fused), (_where(plain, False), self._filtered)):
            idx = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
            sub = [params[i] for i in rows]
            tok, lp = fn(
                logits.index_select(0, idx), temp.index_select(0, idx), key.index_select(0, idx), sub
            )
            tokens.index_copy_(0, idx, tok)
            logps.index_copy_(0, idx, lp)
        return tokens, logps

    def _fused(
        self, logits: torch.Tensor, temp: torch.Tensor, key: torch.Tensor, _params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from astraflow.engines import triton_sampling

        tok, lp = triton_sampling.fused_sample(logits, temp, key)
        return tok.long(), lp

    def _filtered(
        self, logits: torch.Tensor, temp: torch.Tensor, key: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from astraflow.engines import triton_sampling

        return self._pick(logits, temp, triton_sampling.gumbel_noise(key, logits.shape[1]), params)

    def _pick(
        self, logits: torch.Tensor, temp: torch.Tensor, noise: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gumbel-max over processed_logprobs (per-row filters), with the chosen token's logprob."""
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        # the rows processed_logprobs filters, found on the host by its own rule (no device read)
        rows = torch.nonzero(((top_k > 0) & (top_k < logits.shape[1])) | (top_p < 1.0)).squeeze(-1)
        logp = processed_logprobs(
            logits,
            temp,
            to_device(top_p, self.device),
            to_device(top_k, self.device),
            filter_rows=to_device(rows, self.device),
        )
        tok = (logp + noise).argmax(dim=-1)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def _where(flags: list[bool], value: bool) -> list[int]:
    """Indices of the rows whose flag is `value`."""
    return [i for i, f in enumerate(flags) if f is value]


def stacked(tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Tokens and logprobs as one [2, n] float64 tensor (every token id is exact in a float64), so
    one device-to-host transfer carries both."""
    return torch.stack([tok.double(), lp.double()])


def lists(both: torch.Tensor) -> tuple[list[int], list[float]]:
    """Tokens and logprobs from a host copy of `stacked`."""
    return [int(t) for t in both[0].tolist()], both[1].tolist()


def to_lists(tok: torch.Tensor, lp: torch.Tensor) -> tuple[list[int], list[float]]:
    """One device-to-host transfer for both (it waits for the device)."""
    return lists(stacked(tok, lp).cpu())

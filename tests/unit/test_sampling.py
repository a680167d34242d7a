"""The processed sampling distribution shared by the engine and the trainer."""

from __future__ import annotations

import math

import torch

from astraflow.engines.sampler import Sampler
from astraflow.engines.sampling import processed_logprobs
from astraflow.protocol.messages import SamplingParams


def test_plain_is_tempered_log_softmax() -> None:
    logits = torch.randn(3, 11)
    got = processed_logprobs(logits, 0.7)
    assert torch.allclose(got, torch.log_softmax(logits / 0.7, -1))


def test_top_k_keeps_k_largest_and_renormalises() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    got = processed_logprobs(logits, 1.0, 1.0, 2)
    kept = torch.isfinite(got[0]).nonzero().flatten().tolist()
    assert kept == [0, 2]
    want = torch.log_softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(got[0, [0, 2]], want)
    assert math.isclose(got[0].exp().sum().item(), 1.0, rel_tol=1e-6)


def test_top_p_matches_the_engine_sampler() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    temp = torch.full((64,), 0.9)
    top_p = torch.rand(64) * 0.9 + 0.05
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    toks, lps = Sampler(torch.device("cpu"), use_triton=False).sample(
        logits, [SamplingParams(temperature=0.9, top_p=p) for p in top_p.tolist()], [0] * 64, [0] * 64, gens
    )
    tokens, chosen = torch.tensor(toks), torch.tensor(lps)
    logp = processed_logprobs(logits, temp, top_p)
    assert torch.allclose(logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), chosen, atol=1e-5)
    # nucleus: the smallest prefix reaching top_p, the top token always in
    assert bool(torch.isfinite(logp).sum(-1).ge(1).all())
    full = torch.softmax(logits / 0.9, -1)
    kept_mass = (full * torch.isfinite(logp)).sum(-1)
    assert bool((kept_mass >= top_p - 1e-5).all())


def test_per_row_settings_and_off_values() -> None:
    logits = torch.randn(2, 8)
    got = processed_logprobs(logits, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.5]), torch.tensor([0, 3]))
    assert torch.allclose(got[0], torch.log_softmax(logits[0], -1))
    assert int(torch.isfinite(got[1]).sum()) <= 3


def test_cpu_noise_is_a_function_of_seed_and_index_and_samples_the_distribution() -> None:
    from astraflow.engines.sampler import hashed_gumbel, step_seeds

    keys = step_seeds([7, 7, 8], [0, 1, 0])
    noise = hashed_gumbel(keys, 5)
    assert torch.equal(noise, hashed_gumbel(keys, 5))  # the same (seed, index): the same noise
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # no generators given: the engine's path; 20,000 rows of distinct seeds sample p closely
    n = 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(n, 4)
    toks, _ = Sampler(torch.device("cpu"), use_triton=False).sample(
        logits, [SamplingParams()] * n, list(range(n)), [0] * n, [None] * n
    )
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)


def _mixed_rows(scale: float, seed: int = 0) -> tuple[torch.Tensor, list[tuple[float, float, int]]]:
    """Random logits over a large vocabulary and per-row settings mixing filters on and off."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 32000, generator=gen) * scale
    rows = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 0), (1.0, 1.0, 50), (0.8, 0.5, 20), (1.0, 1.0, 0),
            (0.6, 1.0, 32000), (1.1, 0.95, 0)]  # fmt: skip
    return logits, rows


def test_mixed_rows_are_each_exactly_their_own_distribution() -> None:
    """A batch mixing top-p / top-k rows with unfiltered ones: each row equals itself computed alone,
    and an unfiltered row is exactly its log_softmax (float32 cumsums once masked tail tokens of a
    top_p = 1 row whenever another row used top-p)."""
    for scale in (0.5, 3.0, 20.0):
        logits, rows = _mixed_rows(scale)
        t, p, k = (torch.tensor(c) for c in zip(*rows, strict=True))
        got = processed_logprobs(logits, t, p, k)
        for i, (ti, pi, ki) in enumerate(rows):
            alone = processed_logprobs(logits[i : i + 1], ti, pi, ki)[0]
            assert torch.equal(got[i], alone), (scale, rows[i])
            if pi == 1.0 and (ki == 0 or ki >= logits.shape[1]):
                assert torch.equal(got[i], torch.log_softmax(logits[i] / ti, -1)), (scale, rows[i])
                assert bool(torch.isfinite(got[i]).all())
            if pi == 1.0 and 0 < ki < logits.shape[1]:
                assert int(torch.isfinite(got[i]).sum()) == ki  # a whole top-k, no nucleus cut


def test_sampler_rows_do_not_depend_on_their_batch_mates() -> None:
    """The engine's sampler: a row's logprob is that of its own settings, alone or beside others."""
    logits, rows = _mixed_rows(3.0, seed=1)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in rows]
    sampler = Sampler(torch.device("cpu"), use_triton=False)
    seeds = list(range(len(rows)))
    toks, lps = sampler.sample(logits, params, seeds, [0] * len(rows), [None] * len(rows))
    for i in range(len(rows)):
        tok, lp = sampler.sample(logits[i : i + 1], [params[i]], [seeds[i]], [0], [None])
        assert (tok[0], lp[0]) == (toks[i], lps[i])
        ref = processed_logprobs(logits[i : i + 1], rows[i][0], rows[i][1], rows[i][2])[0, toks[i]]
        assert lps[i] == float(ref)

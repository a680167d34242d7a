"""The embedded engine's GPU path: Triton kernels against the PyTorch ops they replace, fused sampling
against the unfused one, prefill graphs against the eager prefill (and a timing print of both), and
the whole engine (CUDA graphs for prefill and decode, Triton) against a fresh HF forward, including a
weight swap between graph replays, with both decode loops (the overlapped one against the synchronous
one too). Skipped without a GPU."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton_ops = pytest.importorskip("astraflow.engines.triton_ops")

from astraflow.engines import ops, triton_sampling  # noqa: E402
from astraflow.engines.base import GenerationRequest  # noqa: E402
from astraflow.engines.prefill_graphs import bucket  # noqa: E402
from astraflow.engines.runners import CachedRunner  # noqa: E402
from astraflow.engines.sampling import processed_logprobs  # noqa: E402
from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from astraflow.models.init import init_model  # noqa: E402
from astraflow.protocol.messages import SamplingParams  # noqa: E402

DEV = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_ops_match_torch_ops(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    b, h, hk, d, s, length, n = 37, 16, 8, 128, 40, 300, 1024
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    x, r = torch.randn(b, n, device=DEV, dtype=dtype), torch.randn(b, n, device=DEV, dtype=dtype)
    w = torch.randn(n, device=DEV, dtype=dtype)
    for res in (None, r):
        got, want = triton_ops.rmsnorm(x, w, 1e-6, res), ops.rmsnorm(x, w, 1e-6, res)
        assert _rel(got[0], want[0]) < tol and _rel(got[1], want[1]) < tol
    qkv = torch.randn(b, (h + 2 * hk) * d, device=DEV, dtype=dtype)
    qw, kw = torch.randn(d, device=DEV, dtype=dtype), torch.randn(d, device=DEV, dtype=dtype)
    pos = torch.randint(0, length, (b,), device=DEV)
    ang = torch.rand(b, d // 2, device=DEV) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    kc = torch.randn(s, hk, length + 1, d, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    q1 = ops.qk_norm_rope_write(qkv, qw, kw, cos, sin, pos, kc, vc, 1e-6, h, hk)
    q2 = triton_ops.qk_norm_rope_write(qkv, qw, kw, cos, sin, pos, kc2, vc2, 1e-6, h, hk)
    assert _rel(q2, q1) < tol and _rel(kc2, kc) < tol and torch.equal(vc2, vc)
    lens = pos + 1
    want = ops.decode_attention(q1, kc, vc, lens, length + 1)
    assert _rel(triton_ops.decode_attention(q1, kc, vc, lens, length + 1), want) < tol
    gu = torch.randn(b, 2 * 3072, device=DEV, dtype=dtype)
    assert _rel(triton_ops.silu_mul(gu), ops.silu_mul(gu)) < tol


def test_fused_sampling_matches_the_unfused_path_and_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 151936, device=DEV, dtype=torch.bfloat16) * 4
    temp = torch.rand(64, device=DEV) + 0.5
    seeds = torch.randint(0, 2**62, (64,), device=DEV)
    tok, lp = triton_sampling.fused_sample(logits, temp, seeds)
    logp = processed_logprobs(logits, temp)
    ref = (logp + triton_sampling.gumbel_noise(seeds, logits.shape[1])).argmax(-1)
    assert torch.equal(tok.long(), ref)
    assert torch.allclose(lp, logp.gather(1, ref[:, None]).squeeze(1), atol=1e-4)
    n = 200_000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], device=DEV)
    t, _ = triton_sampling.fused_sample(
        probs.log().expand(n, 4).contiguous(), torch.ones(n, device=DEV), torch.arange(n, device=DEV) * 7919
    )
    freq = torch.bincount(t.long(), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.005)


def test_sampler_rows_of_a_mixed_batch_are_their_own() -> None:
    """Plain rows beside filtered ones keep the fused kernel, filtered rows their own filters: each
    row samples what it samples alone, with its own logprob."""
    from astraflow.engines.sampler import Sampler

    torch.manual_seed(1)
    logits = torch.randn(6, 151936, device=DEV, dtype=torch.bfloat16) * 4
    params = [
        SamplingParams(),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=20),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_p=0.8, top_k=50),
    ]
    sampler = Sampler(DEV, use_triton=True)
    seeds = [11 * i + 3 for i in range(len(params))]
    toks, lps = sampler.sample(logits, params, seeds, [0] * len(params), [None] * len(params))
    for i, p in enumerate(params):
        tok, lp = sampler.sample(logits[i : i + 1], [p], [seeds[i]], [0], [None])
        assert tok[0] == toks[i] and abs(lp[0] - lps[i]) < 1e-5, (i, p)
        ref = processed_logprobs(logits[i : i + 1], p.temperature, p.top_p, p.top_k)[0, toks[i]]
        assert abs(float(ref) - lps[i]) < 1e-4, (i, p)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpu-engine")
    return init_model("qwen3", "tiny", root / "a", seed=0), init_model("qwen3", "tiny", root / "b", seed=1)


def _ref_logprobs(model: Any, req: GenerationRequest, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([req.prompt_ids + tokens], device=DEV)).logits[0]
    logp = processed_logprobs(logits, req.sampling.temperature, req.sampling.top_p, req.sampling.top_k)
    n = len(req.prompt_ids)
    return [float(logp[n - 1 + k, t]) for k, t in enumerate(tokens)]


@pytest.mark.parametrize("loop", ["sync", "overlap"])
def test_graph_engine_logprobs_and_weight_swap_between_replays(models: tuple[Path, Path], loop: str) -> None:
    from transformers import AutoModelForCausalLM

    config = TorchEngineConfig(max_batch=16, max_seq_len=64, decode_loop=loop)
    eng = TorchEngine(str(models[0]), config, device="cuda")
    assert eng.runner.graphs is not None and eng.runner.uses_triton
    new = AutoModelForCausalLM.from_pretrained(models[1]).state_dict()
    old = {k: v.clone() for k, v in eng.model.state_dict().items()}
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 14, 5 + i, 6, 7][: 2 + i % 4], max_new_tokens=12, sampling=SamplingParams()
        )
        for i in range(5)
    ]
    reqs += [
        GenerationRequest(
            prompt_ids=[1, 16, 4], max_new_tokens=12, sampling=SamplingParams(top_k=5, top_p=0.9)
        )
        for _ in range(3)
    ]
    decode = eng.runner.decode
    calls = {"n": 0}

    def staging(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            eng.load_weights(1, new)
        return decode(*args)

    eng.runner.decode = staging
    try:
        outs = asyncio.run(eng.generate(reqs))
    finally:
        eng.close()
    assert eng.runner.prefill_graphs is not None and eng.runner.prefill_graphs.graphs  # prefill replayed
    for req, out in zip(reqs, outs, strict=True):
        assert out.versions == [0] * 5 + [1] * 7
        eng.model.load_state_dict(old)
        before = _ref_logprobs(eng.model, req, out.token_ids)[:5]
        eng.model.load_state_dict(new)
        after = _ref_logprobs(eng.model, req, out.token_ids)[5:]
        # float32 weights; Triton's dots run in tf32, hence the tolerance.
        assert max(abs(a - b) for a, b in zip(before + after, out.logprobs, strict=True)) < 2e-2


def test_overlapped_loop_gives_the_synchronous_loops_numbers(models: tuple[Path, Path]) -> None:
    """Rows of one length make the same batches in both loops (the overlapped one adds a last,
    discarded step), so with the same seeds the completions are the same bit for bit, through CUDA
    graphs, the fused sampler and the filtered one."""
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 14, 5 + i % 7, 6],
            max_new_tokens=10,
            seed=100 + i,
            sampling=SamplingParams(top_k=5, top_p=0.9) if i % 3 == 0 else SamplingParams(),
        )
        for i in range(12)
    ]
    outs = {}
    for loop in ("sync", "overlap"):
        config = TorchEngineConfig(max_batch=16, max_seq_len=64, decode_loop=loop)
        eng = TorchEngine(str(models[0]), config, device="cuda")
        try:
            outs[loop] = asyncio.run(eng.generate(reqs))
        finally:
            eng.close()
    for a, b in zip(outs["sync"], outs["overlap"], strict=True):
        assert (a.token_ids, a.logprobs, a.versions) == (b.token_ids, b.logprobs, b.versions)


@pytest.mark.parametrize("loop", ["sync", "overlap"])
def test_two_engines_of_one_process_capture_and_decode_at_once(models: tuple[Path, Path], loop: str) -> None:
    """A RaaS holding two policies runs two engines on one GPU, each decoding on a thread of its own:
    both capture their graphs for new batch sizes at the same moments and must all finish."""
    import threading

    config = TorchEngineConfig(max_batch=64, max_seq_len=64, decode_loop=loop)
    engines = [TorchEngine(str(m), config, device="cuda") for m in models]
    errors: list[BaseException] = []
    start = threading.Barrier(len(engines))

    def drive(eng: TorchEngine, seed: int) -> None:
        try:
            start.wait()
            for n in (1, 3, 7, 13, 29, 64):  # a new bucket every round: a capture each
                reqs = [
                    GenerationRequest(
                        prompt_ids=[1, 5 + (i + seed) % 7, 6], max_new_tokens=6, sampling=SamplingParams()
                    )
                    for i in range(n)
                ]
                outs = asyncio.run(eng.generate(reqs))
                assert len(outs) == n and all(o.token_ids for o in outs)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(e, i)) for i, e in enumerate(engines)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        for e in engines:
            e.close()
    assert not errors, errors
    assert all(len(e.runner.graphs.graphs) >= 5 for e in engines)


def _runner(path: Path, dtype: torch.dtype, slots: int, max_len: int) -> CachedRunner:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEV).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    return CachedRunner(model, slots, max_len, graphs=True, kernels="auto")


def test_prefill_graphs_match_the_eager_prefill_and_refill_their_inputs(models: tuple[Path, Path]) -> None:
    """Two admissions of one bucket replay one graph, each giving its own prompts' logits and KV (the
    static inputs refilled), as the eager unpadded prefill does at bf16; no slot but the prompts' own
    and the scratch slot changes. (The tiny model's vocabulary is 19 tokens.)"""
    runner = _runner(models[0], torch.bfloat16, slots=16, max_len=64)
    fw, graphs = runner.forward, runner.prefill_graphs
    assert graphs is not None and fw.cache.k.shape[1] == 17
    admissions = [
        ([[1, 14, 5, 6, 7], [1, 9], [1, 3, 3, 8, 2, 4, 11]], [3, 0, 7]),
        ([[1, 17, 18], [1, 4, 4, 4, 5, 6, 9, 9, 9, 9, 9, 9], [1, 2, 13]], [1, 5, 2]),
    ]
    for prompts, slots in admissions:
        assert bucket(len(prompts), max(len(p) for p in prompts), fw.cache.max_len) == (4, 16)
        others = [s for s in range(16) if s not in slots]
        k_before, v_before = fw.cache.k[:, others].clone(), fw.cache.v[:, others].clone()
        got = runner.prefill(prompts, slots).clone()
        torch.cuda.synchronize()
        assert torch.equal(fw.cache.k[:, others], k_before) and torch.equal(fw.cache.v[:, others], v_before)
        kv_got = [
            (fw.cache.k[:, s, :, : len(p)].clone(), fw.cache.v[:, s, :, : len(p)].clone())
            for p, s in zip(prompts, slots, strict=True)
        ]
        want = fw.prefill(prompts, slots)  # eager, unpadded
        assert got.shape == want.shape
        assert _rel(got, want) < 2e-2
        for (k, v), p, s in zip(kv_got, prompts, slots, strict=True):
            assert _rel(k, fw.cache.k[:, s, :, : len(p)]) < 2e-2
            assert _rel(v, fw.cache.v[:, s, :, : len(p)]) < 2e-2
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True)):
            assert _rel(got[i], fw.prefill([p], [s])[0]) < 2e-2  # each row is its own prompt's
    assert list(graphs.graphs) == [(4, 16)]  # captured once, replayed for the second admission
    one = runner.prefill([[1, 7]], [9]).clone()
    assert sorted(graphs.graphs) == [(1, 16), (4, 16)]
    assert _rel(one, fw.prefill([[1, 7]], [9])) < 2e-2


def test_prefill_graph_against_eager_prefill_timing(tmp_path: Path) -> None:
    """Not an assertion: prints the host-bound eager prefill's time against the graph's, at Qwen3-0.6B's
    shape in bf16, for one 2-token prompt and for 16 prompts of 60 tokens (run with -s to see it)."""
    path = init_model("qwen3", "0.6b-shape", tmp_path / "m", seed=0, device="cuda")
    runner = _runner(path, torch.bfloat16, slots=64, max_len=512)
    fw = runner.forward

    def timed(fn: Any, prompts: list[list[int]], slots: list[int]) -> float:
        fn(prompts, slots)
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn(prompts, slots)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    for n, width in ((1, 2), (16, 60)):
        prompts = [[1 + (i * 7 + j) % 1000 for j in range(width)] for i in range(n)]
        slots = list(range(n))
        eager = timed(fw.prefill, prompts, slots)
        graph = timed(runner.prefill, prompts, slots)
        print(f"prefill {n} x {width} tokens: eager {eager:.2f} ms, graph {graph:.2f} ms (median of 20)")

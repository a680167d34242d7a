"""The RolloutEngine contract, run against every engine: behaviour logprobs equal the trainer's
recomputation (filtered and unfiltered rows in one batch, and a multi-turn Transcript with per-turn
overrides), each completion reports the settings it was sampled with, per-token versions across a weight update mid-generation (and no stale prefix cache
after it), stop ids, n samples per prompt, capacity, and a clean close.

Tolerances on |engine logprob - trainer logprob|, per token (float32 everywhere): the embedded engine
and the FAKE SGLang server run the same transformers model as the trainer (1e-4); vLLM runs its own
kernels (fused QKV, its CPU attention), so its logits differ in the last bits (2e-3)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from astraflow.engines.base import Completion, GenerationRequest
from astraflow.engines.sampling import processed_logprobs
from astraflow.protocol.messages import SamplingParams
from astraflow.trainers.torch_trainer import token_logprobs
from tests.contract.conftest import CAPACITY, Harness, Models

TOLERANCE = {"torch": 1e-4, "torch-overlap": 1e-4, "vllm": 2e-3, "sglang": 1e-4}
"""Largest per-token |engine - trainer| logprob difference accepted, per engine kind."""


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _reference(models: Models, version: int, req: GenerationRequest, tokens: list[int]) -> list[float]:
    """The trainer's logprob of each generated token: one forward over prompt + completion, under the
    processed distribution (temperature, top-k, top-p) the request sampled from."""
    model = models.hf(version)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([req.prompt_ids + tokens])).logits[0].float()
    n = len(req.prompt_ids)
    lp = processed_logprobs(
        logits[n - 1 : n - 1 + len(tokens)], req.sampling.temperature, req.sampling.top_p, req.sampling.top_k
    )
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def _assert_matches(h: Harness, req: GenerationRequest, out: Completion) -> None:
    """The engine reports the settings it sampled with (here: those asked), and every token's behaviour
    logprob equals the recomputation under those settings and the version it is tagged with."""
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions)
    assert isinstance(out.sampling, SamplingParams) and out.sampling == req.sampling
    for version in sorted(set(out.versions)):
        ref = _reference(h.models, version, req, out.token_ids)
        for i, (got, want, v) in enumerate(zip(out.logprobs, ref, out.versions, strict=True)):
            if v != version:
                continue
            assert want > float("-inf"), f"token {i} ({out.token_ids[i]}) is outside the sampling support"
            assert abs(got - want) <= TOLERANCE[h.kind], (
                f"{h.kind}: token {i} of version {v}: engine {got:.6f} vs trainer {want:.6f}"
            )


def test_tempered_logprobs_equal_the_trainers(harness: Harness) -> None:
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 14, 5], max_new_tokens=16, seed=1, sampling=SamplingParams(temperature=1.0)
        ),
        GenerationRequest(
            prompt_ids=[1, 14, 7, 8, 9, 10, 18],
            max_new_tokens=16,
            seed=2,
            sampling=SamplingParams(temperature=0.7),
        ),
        GenerationRequest(
            prompt_ids=[1, 16, 4, 17, 6, 18],
            max_new_tokens=16,
            seed=3,
            sampling=SamplingParams(temperature=1.3),
        ),
    ]
    outs = _run(harness.engine.generate(reqs))
    assert len(outs) == len(reqs)
    for req, out in zip(reqs, outs, strict=True):
        assert len(out.token_ids) == 16 and out.finish_reason == "length"
        _assert_matches(harness, req, out)
    # The same numbers through the trainer's own function (temperature only, as it trains).
    req, out = reqs[1], outs[1]
    tokens = torch.tensor([req.prompt_ids + out.token_ids])
    with torch.no_grad():
        lp = token_logprobs(
            harness.models.hf(harness.engine.version),
            tokens,
            torch.ones_like(tokens),
            temperature=req.sampling.temperature,
        )[0, len(req.prompt_ids) - 1 :]
    assert torch.allclose(lp, torch.tensor(out.logprobs), atol=TOLERANCE[harness.kind], rtol=0)


def test_top_p_top_k_logprobs_are_of_the_processed_distribution(harness: Harness) -> None:
    """Filtered rows decoded in one batch with unfiltered ones: each row under its own settings."""
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 18], max_new_tokens=16, seed=4, sampling=SamplingParams(temperature=1.0, top_p=0.8)
        ),
        GenerationRequest(
            prompt_ids=[1, 15, 3],
            max_new_tokens=16,
            seed=5,
            sampling=SamplingParams(temperature=0.9, top_k=4),
        ),
        GenerationRequest(
            prompt_ids=[1, 11, 9],
            max_new_tokens=16,
            seed=6,
            sampling=SamplingParams(temperature=1.2, top_p=0.9, top_k=6),
        ),
        GenerationRequest(prompt_ids=[1, 15, 4], max_new_tokens=16, seed=7, sampling=SamplingParams()),
        GenerationRequest(
            prompt_ids=[1, 12, 9], max_new_tokens=16, seed=8, sampling=SamplingParams(temperature=0.8)
        ),
    ]
    if harness.kind == "sglang":
        # SGLang returns logprobs of the tempered distribution, not the top-p/top-k renormalised one:
        # the plugin refuses such requests rather than hand the trainer a wrong ratio.
        from astraflow.errors import AstraflowError

        with pytest.raises(AstraflowError, match="top_p"):
            _run(harness.engine.generate(reqs[:1]))
        return
    outs = _run(harness.engine.generate(reqs))
    for req, out in zip(reqs, outs, strict=True):
        _assert_matches(harness, req, out)


def test_n_samples_per_prompt(harness: Harness) -> None:
    req = GenerationRequest(
        prompt_ids=[1, 12, 5, 6], max_new_tokens=10, seed=11, sampling=SamplingParams(temperature=1.0)
    )
    group = _run(harness.engine.generate_n(req, 4))
    assert len(group) == 4
    for out in group:
        assert len(out.token_ids) == 10 and out.finish_reason == "length"
        _assert_matches(harness, req, out)
    assert len({tuple(o.token_ids) for o in group}) > 1, "the n samples of a group must differ"
    again = _run(harness.engine.generate_n(req, 4))
    assert [o.token_ids for o in again] == [o.token_ids for o in group], "seeded groups are reproducible"


def test_multi_turn_transcript_with_per_turn_overrides(harness: Harness) -> None:
    """The transcript path: the RaaS's policy client over the engine, two policy turns of one
    Transcript, each with per-call overrides (top-k too where the engine samples with it). The
    Sequence carries the settings the engine reported, and the trainer's recomputation over the whole
    multi-turn sequence under them matches every policy token's behaviour logprob."""
    from transformers import AutoTokenizer

    from astraflow.config.recipe import SamplingConfig
    from astraflow.roles.policy_client import EnginePolicyClient
    from astraflow.workflows.transcript import Transcript

    tok = AutoTokenizer.from_pretrained(harness.models.a)
    cfg = SamplingConfig(max_new_tokens=6)
    client = EnginePolicyClient("main", tok, harness.engine, cfg, stop_ids=[])
    ov: dict[str, Any] = (
        {"temperature": 0.8} if harness.kind == "sglang" else {"temperature": 0.8, "top_k": 4}
    )

    async def episode() -> Any:
        tr = Transcript(client, chat=False)
        tr.add_ids([1, 14, 5, 18])
        await tr.generate(**ov, seed=51)
        tr.add_ids([16, 7])  # the environment's reply, masked
        await tr.generate(**ov, seed=52)
        return tr.sequence(1.0)

    seq = _run(episode())
    assert seq.sampling == SamplingParams(**ov)
    assert sum(seq.loss_mask) == 12 and seq.turns == [(4, 6, True), (12, 6, True)]
    sp = seq.sampling
    for version in sorted({v for v in seq.versions if v >= 0}):
        with torch.no_grad():
            logits = harness.models.hf(version)(input_ids=torch.tensor([seq.tokens])).logits[0].float()
        lp = processed_logprobs(logits[:-1], sp.temperature, sp.top_p, sp.top_k)
        for i in range(1, len(seq.tokens)):
            if seq.loss_mask[i] and seq.versions[i] == version:
                want = float(lp[i - 1, seq.tokens[i]])
                assert abs(want - seq.logprobs[i]) <= TOLERANCE[harness.kind], (harness.kind, i, want)


def test_stop_ids_end_a_sequence_and_are_kept(harness: Harness) -> None:
    base = GenerationRequest(
        prompt_ids=[1, 13, 8, 2], max_new_tokens=16, seed=21, sampling=SamplingParams(temperature=1.0)
    )
    (free,) = _run(harness.engine.generate([base]))
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    # Stop at the first token that did not occur before it (position >= 2 when there is one).
    j = next((k for k in range(2, 16) if free.token_ids[k] not in free.token_ids[:k]), 0)
    stop = free.token_ids[j]
    req = GenerationRequest(**{**base.__dict__, "stop_ids": [stop]})
    (cut,) = _run(harness.engine.generate([req]))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: j + 1], "same seed: the same tokens, ending with the stop id"
    assert len(cut.logprobs) == len(cut.versions) == j + 1


def test_capacity_and_more_requests_than_it(harness: Harness) -> None:
    assert harness.engine.capacity() == CAPACITY
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 4 + i % 10],
            max_new_tokens=4,
            seed=100 + i,
            sampling=SamplingParams(temperature=1.0),
        )
        for i in range(2 * CAPACITY + 3)
    ]
    outs = _run(harness.engine.generate(reqs))
    assert [len(o.token_ids) for o in outs] == [4] * len(reqs)


def test_versions_across_a_weight_update_mid_generation(harness: Harness) -> None:
    eng = harness.engine
    v0 = eng.version
    probe = GenerationRequest(
        prompt_ids=[1, 14, 5, 6, 7, 8], max_new_tokens=8, seed=31, sampling=SamplingParams(temperature=1.0)
    )
    (before,) = _run(eng.generate([probe]))  # leaves the probe's prompt in any prefix cache
    assert before.versions == [v0] * 8
    long = [
        GenerationRequest(
            prompt_ids=[1, 14, 5, 6 + i],
            max_new_tokens=200,
            seed=40 + i,
            sampling=SamplingParams(temperature=1.0),
        )
        for i in range(3)
    ]

    async def update_mid_generation(v: int, delay_s: float) -> list[Completion]:
        task = asyncio.ensure_future(eng.generate(long))
        await asyncio.sleep(delay_s)
        eng.load_weights(v + 1, harness.models.state_dict(v + 1))
        return await task

    # When the update lands depends on the machine's load: too early, no token of the old version;
    # too late, none of the new. Every attempt must be correct; one must show the switch inside a
    # sequence, and the delay moves towards where the switch falls inside.
    delay_s, switched = 0.3, False
    for _ in range(6):
        v = eng.version
        outs = _run(update_mid_generation(v, delay_s))
        for req, out in zip(long, outs, strict=True):
            assert len(out.token_ids) == 200
            assert set(out.versions) <= {v, v + 1}
            assert out.versions == sorted(out.versions), "versions never go back"
            _assert_matches(harness, req, out)  # old tokens match the old weights, new ones the new
        deadline = time.monotonic() + 30
        while eng.version != v + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.version == v + 1
        if any(out.versions[0] == v and out.versions[-1] == v + 1 for out in outs):
            switched = True
            break
        early = all(out.versions[0] == v + 1 for out in outs)  # the update came before any token
        delay_s = delay_s * 2 if early else delay_s / 2
    assert switched, "the switch shows inside a sequence"
    (after,) = _run(eng.generate([probe]))
    assert after.versions == [eng.version] * 8 and eng.version > v0
    _assert_matches(harness, probe, after)  # a stale cached prompt KV would give the old logprobs


def test_zz_close_is_clean(harness: Harness) -> None:
    """Last in the module: close the shared engine while it decodes."""
    eng = harness.engine
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 5], max_new_tokens=120, seed=7, sampling=SamplingParams(temperature=1.0)
        )
    ]

    async def close_while_decoding() -> Any:
        task = asyncio.ensure_future(eng.generate(reqs))
        await asyncio.sleep(0.1)
        await asyncio.wait_for(asyncio.to_thread(eng.close), timeout=60)
        done, _ = await asyncio.wait({task}, timeout=30)
        assert task in done, "a call in flight at close neither finished nor failed"
        return task.exception()

    exc = _run(close_while_decoding())
    assert exc is None or isinstance(exc, RuntimeError)
    with pytest.raises(RuntimeError):
        _run(
            eng.generate([GenerationRequest(prompt_ids=[1, 5], max_new_tokens=2, sampling=SamplingParams())])
        )
    eng.close()  # closing twice is harmless

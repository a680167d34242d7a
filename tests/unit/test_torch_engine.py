"""The embedded engine: exact behaviour logprobs, continuous batching, prompts shared by a group,
weight updates between decode steps (partial rollouts), weight checks, a failing decode loop, stop
handling, top-k/top-p and seeded sampling; our Qwen3 forward against transformers' logits. The tests
of an engine run with both decode loops (engine_options.decode_loop: sync and overlap).
Over 400 lines because the tests share the module's two models, which a split would build twice."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.engines.base import GenerationRequest
from astraflow.engines.qwen3_forward import Qwen3Forward
from astraflow.engines.sampler import Sampler
from astraflow.engines.sampling import processed_logprobs
from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig
from astraflow.errors import AstraflowError, EngineFailedError, WeightsMismatchError
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("engine")
    return init_model("qwen3", "tiny", root / "a", seed=0), init_model("qwen3", "tiny", root / "b", seed=1)


LOOPS = ["sync", "overlap"]


@pytest.fixture(params=LOOPS)
def engine(model_dirs: tuple[Path, Path], request: pytest.FixtureRequest) -> Iterator[TorchEngine]:
    config = TorchEngineConfig(max_batch=16, batch_wait_s=0.02, decode_loop=request.param)
    eng = TorchEngine(str(model_dirs[0]), config, seed=3)
    yield eng
    eng.close()


def _full_logprobs(
    model: Any, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    n = len(prompt)
    return [float(logp[n - 1 + k, t]) for k, t in enumerate(completion)]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_behaviour_logprobs_match_a_fresh_forward(engine: TorchEngine) -> None:
    # Different prompt lengths exercise left padding, position ids and the cache.
    prompts = [[1, 14, 5], [1, 14, 7, 8, 9, 10, 18], [1, 16, 4, 17, 6, 18], [1, 18]]
    temps = [1.0, 0.7, 1.3, 1.0]
    reqs = [
        GenerationRequest(prompt_ids=p, max_new_tokens=8, sampling=SamplingParams(temperature=t))
        for p, t in zip(prompts, temps, strict=True)
    ]

    async def go() -> list[Any]:
        return await engine.generate(reqs)

    outs = asyncio.run(go())
    for req, out in zip(reqs, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 8
        assert out.finish_reason == "length" and out.versions == [0] * 8
        ref = _full_logprobs(engine.model, req.prompt_ids, out.token_ids, req.sampling.temperature)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_top_p_logprob_is_of_the_renormalised_nucleus() -> None:
    sampler = Sampler(torch.device("cpu"), use_triton=False)
    n = 4000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(n, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    # top_p = 0.7 keeps tokens 0 and 1 (they hold 0.8 of the mass), renormalised to 5/8 and 3/8.
    tokens, logps = sampler.sample(logits, [SamplingParams(top_p=0.7)] * n, [0] * n, [0] * n, gens)
    assert set(tokens) == {0, 1}
    assert abs(tokens.count(1) / n - 0.375) < 0.03
    lp1 = next(lp for t, lp in zip(tokens, logps, strict=True) if t == 1)
    assert lp1 == pytest.approx(float(torch.log(torch.tensor(0.3 / 0.8))), abs=1e-6)


@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_callers_share_batches_up_to_max_batch(model_dirs: tuple[Path, Path], loop: str) -> None:
    config = TorchEngineConfig(max_batch=4, batch_wait_s=0.05, decode_loop=loop)
    eng = TorchEngine(str(model_dirs[0]), config, seed=0)
    sizes: list[int] = []
    decode = eng.runner.decode

    def recording(tokens: list[int], positions: list[int]) -> Any:
        sizes.append(len(tokens))
        return decode(tokens, positions)

    eng.runner.decode = recording

    async def one(i: int) -> Any:
        return (
            await eng.generate(
                [
                    GenerationRequest(
                        prompt_ids=[1, 14, 5 + i % 10], max_new_tokens=3, sampling=SamplingParams()
                    )
                ]
            )
        )[0]

    async def many() -> list[Any]:
        return await asyncio.gather(*(one(i) for i in range(10)))

    try:
        outs = asyncio.run(many())
    finally:
        eng.close()
    assert len(outs) == 10 and all(len(o.token_ids) == 3 for o in outs)
    # Slots are the limit: 10 concurrent requests never decode more than 4 at a time, and they
    # share steps (4 rows at once) rather than running one by one.
    assert max(sizes) == 4
    assert eng.capacity() == 4


def test_stop_ids_end_a_sequence_and_are_kept(engine: TorchEngine) -> None:
    async def go() -> list[Any]:
        # Every token is a stop token, so each sequence ends after one step.
        reqs = [
            GenerationRequest(
                prompt_ids=[1, 14, 5], max_new_tokens=5, stop_ids=list(range(19)), sampling=SamplingParams()
            )
        ]
        reqs.append(GenerationRequest(prompt_ids=[1, 14, 6], max_new_tokens=5, sampling=SamplingParams()))
        return await engine.generate(reqs)

    stopped, full = asyncio.run(go())
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1
    assert full.finish_reason == "length" and len(full.token_ids) == 5


def test_seeded_requests_reproduce_regardless_of_batch_mates(engine: TorchEngine) -> None:
    req = GenerationRequest(
        prompt_ids=[1, 14, 5, 6, 18], max_new_tokens=6, seed=42, sampling=SamplingParams()
    )

    async def alone() -> Any:
        return (await engine.generate([req]))[0]

    async def crowded() -> Any:
        others = [
            GenerationRequest(prompt_ids=[1, 15, 9], max_new_tokens=3, sampling=SamplingParams())
            for _ in range(5)
        ]
        return (await engine.generate([*others, req]))[-1]

    a, b = asyncio.run(alone()), asyncio.run(crowded())
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _generate_with_new_weights_staged_at_the_third_forward(
    engine: TorchEngine, new: dict[str, torch.Tensor], prompt: list[int]
) -> Any:
    """Generate 7 tokens of `prompt`, staging `new` as version 1 while the third forward (prefill,
    decode, decode) runs, so it applies after it: tokens 0-2 are version 0's, 3-6 version 1's."""
    prefill, decode = engine.runner.prefill, engine.runner.decode
    calls = {"n": 0}

    def counting(fn: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:
                engine.load_weights(1, new)
            return fn(*args)

        return wrapped

    engine.runner.prefill, engine.runner.decode = counting(prefill), counting(decode)

    async def go() -> Any:
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=7, sampling=SamplingParams())
        return (await engine.generate([req]))[0]

    try:
        return asyncio.run(go())
    finally:
        engine.runner.prefill, engine.runner.decode = prefill, decode


def test_weights_change_mid_sequence_and_later_tokens_carry_the_new_version(
    engine: TorchEngine, model_dirs: tuple[Path, Path]
) -> None:
    new = _weights(model_dirs[1])
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    prompt = [1, 14, 5, 6, 7, 18]
    out = _generate_with_new_weights_staged_at_the_third_forward(engine, new, prompt)
    assert out.versions == [0, 0, 0, 1, 1, 1, 1]
    assert engine.version == 1
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], new["model.norm.weight"])
    # Tokens before the switch are the old model's, tokens after it the new model's, exactly.
    engine.model.load_state_dict(old)
    before = _full_logprobs(engine.model, prompt, out.token_ids)[:3]
    engine.model.load_state_dict(new)
    after = _full_logprobs(engine.model, prompt, out.token_ids)[3:]
    assert max(abs(a - b) for a, b in zip(before + after, out.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("loop", LOOPS)
def test_kv_on_update_keep_samples_later_tokens_over_the_older_versions_kv(
    model_dirs: tuple[Path, Path], loop: str
) -> None:
    from transformers import AutoModelForCausalLM

    config = TorchEngineConfig(max_batch=16, batch_wait_s=0.02, decode_loop=loop, kv_on_update="keep")
    eng = TorchEngine(str(model_dirs[0]), config, seed=3)
    new = _weights(model_dirs[1])
    prompt = [1, 14, 5, 6, 7, 18]
    try:
        out = _generate_with_new_weights_staged_at_the_third_forward(eng, new, prompt)
        applies = list(eng._stats.applies)
    finally:
        eng.close()
    assert out.versions == [0, 0, 0, 1, 1, 1, 1]
    assert applies and applies[-1][3] == 0.0  # no KV recompute was run
    old = AutoModelForCausalLM.from_pretrained(model_dirs[0])
    newer = AutoModelForCausalLM.from_pretrained(model_dirs[1])
    toks = out.token_ids
    before = _full_logprobs(old, prompt, toks)[:3]
    with torch.no_grad():
        # the prompt and tokens 0-1 keep the KV the old weights wrote; token 2 is the first input the
        # new weights read, so tokens 3.. are sampled by them over that KV
        cache = old(input_ids=torch.tensor([prompt + toks[:2]]), use_cache=True).past_key_values
        logits = newer(input_ids=torch.tensor([toks[2:-1]]), past_key_values=cache).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    after = [float(logp[k, t]) for k, t in enumerate(toks[3:])]
    assert max(abs(a - b) for a, b in zip(before + after, out.logprobs, strict=True)) < 1e-4
    # and that is not what a recompute gives: the new weights over their own KV
    recomputed = _full_logprobs(newer, prompt, toks)[3:]
    assert max(abs(a - b) for a, b in zip(recomputed, after, strict=True)) > 1e-3


def test_load_weights_while_idle_and_from_other_threads(
    engine: TorchEngine, model_dirs: tuple[Path, Path]
) -> None:
    new = _weights(model_dirs[1])
    partial = {"model.norm.weight": new["model.norm.weight"] * 2}
    for version in (5, 6):
        t = threading.Thread(target=engine.load_weights, args=(version, partial))
        t.start()
        t.join()
    assert engine.wait_version(6, timeout=10)
    assert torch.equal(engine.model.model.norm.weight, new["model.norm.weight"] * 2)
    with pytest.raises(WeightsMismatchError):
        engine.load_weights(7, {"no.such.weight": torch.zeros(1)})


def test_closed_engine_refuses_work(model_dirs: tuple[Path, Path]) -> None:
    eng = TorchEngine(str(model_dirs[0]), seed=0)
    eng.close()

    async def go() -> Any:
        return await eng.generate(
            [GenerationRequest(prompt_ids=[1, 14], max_new_tokens=2, sampling=SamplingParams())]
        )

    with pytest.raises(RuntimeError):
        asyncio.run(go())


def _processed_ref(model: Any, req: GenerationRequest, completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([req.prompt_ids + completion])).logits[0]
    logp = processed_logprobs(logits, req.sampling.temperature, req.sampling.top_p, req.sampling.top_k)
    n = len(req.prompt_ids)
    return [float(logp[n - 1 + k, t]) for k, t in enumerate(completion)]


def test_a_request_arriving_mid_batch_joins_the_running_batch(engine: TorchEngine) -> None:
    sizes: list[int] = []
    decode = engine.runner.decode

    def recording(tokens: list[int], positions: list[int]) -> Any:
        sizes.append(len(tokens))
        return decode(tokens, positions)

    engine.runner.decode = recording
    long = GenerationRequest(prompt_ids=[1, 14, 5, 6], max_new_tokens=40, sampling=SamplingParams())
    short = GenerationRequest(
        prompt_ids=[1, 16, 4, 17, 6, 18, 9], max_new_tokens=4, sampling=SamplingParams()
    )

    async def go() -> tuple[Any, Any, bool]:
        first = asyncio.ensure_future(engine.generate([long]))
        while len(sizes) < 3:  # the long request is decoding
            await asyncio.sleep(0.001)
        second = (await engine.generate([short]))[0]
        done = first.done()
        return (await first)[0], second, done

    a, b, long_done_when_short_finished = asyncio.run(go())
    assert not long_done_when_short_finished  # the short one did not wait for the running batch
    assert 2 in sizes and sizes[0] == 1 and sizes[-1] == 1  # joined, then left when it finished
    for req, out in ((long, a), (short, b)):
        ref = _processed_ref(engine.model, req, out.token_ids)
        assert max(abs(x - y) for x, y in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_a_group_prompt_is_prefilled_once_and_shared(engine: TorchEngine) -> None:
    prefilled: list[int] = []
    prefill = engine.runner.prefill

    def recording(prompts: list[list[int]], slots: list[int]) -> Any:
        prefilled.append(len(prompts))
        return prefill(prompts, slots)

    engine.runner.prefill = recording
    group = [
        GenerationRequest(
            prompt_ids=[1, 14, 5, 6, 7], max_new_tokens=6, sampling=SamplingParams(temperature=1.5)
        )
        for _ in range(8)
    ]
    other = GenerationRequest(prompt_ids=[1, 15, 9], max_new_tokens=6, sampling=SamplingParams())
    outs = asyncio.run(engine.generate([*group, other]))
    assert prefilled == [2]  # two distinct prompts, one prefill row each
    assert len({tuple(o.token_ids) for o in outs[:8]}) > 1  # the samples are independent
    for req, out in zip([*group, other], outs, strict=True):
        ref = _processed_ref(engine.model, req, out.token_ids)
        assert max(abs(x - y) for x, y in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_top_k_and_top_p_logprobs_are_the_processed_distributions(engine: TorchEngine) -> None:
    reqs = [
        GenerationRequest(prompt_ids=[1, 14, 5], max_new_tokens=10, sampling=SamplingParams(top_k=3)),
        GenerationRequest(
            prompt_ids=[1, 16, 4],
            max_new_tokens=10,
            sampling=SamplingParams(top_k=5, top_p=0.8, temperature=0.8),
        ),
        GenerationRequest(prompt_ids=[1, 18], max_new_tokens=10, sampling=SamplingParams()),
    ]
    outs = asyncio.run(engine.generate(reqs))
    for req, out in zip(reqs, outs, strict=True):
        ref = _processed_ref(engine.model, req, out.token_ids)
        assert all(r > float("-inf") for r in ref)  # every token inside its step's top-k / nucleus
        assert max(abs(x - y) for x, y in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_mismatched_weights_are_refused_without_touching_the_model(engine: TorchEngine) -> None:
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    norm = before["model.norm.weight"]
    bad = [
        {"model.norm.weight": torch.zeros(norm.shape[0] + 1)},  # shape
        {"model.norm.weight": torch.zeros(norm.shape, dtype=torch.int64)},  # dtype kind
        {"model.norm.weight": norm * 2, "model.no_such.weight": torch.zeros(3)},  # unknown name
    ]
    for sd in bad:
        with pytest.raises(WeightsMismatchError):
            engine.load_weights(9, sd)
    assert engine.version == 0 and engine.healthy()
    out = asyncio.run(
        engine.generate(
            [GenerationRequest(prompt_ids=[1, 14, 5], max_new_tokens=3, sampling=SamplingParams())]
        )
    )[0]
    assert out.versions == [0, 0, 0]
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


def test_a_failing_decode_loop_fails_callers_fast_and_reports_unhealthy(engine: TorchEngine) -> None:
    def broken(tokens: list[int], positions: list[int]) -> Any:
        raise RuntimeError("device lost")

    engine.runner.decode = broken
    req = GenerationRequest(prompt_ids=[1, 14, 5], max_new_tokens=4, sampling=SamplingParams())
    with pytest.raises(EngineFailedError, match="device lost"):
        asyncio.run(engine.generate([req, req]))
    assert not engine.healthy() and "device lost" in (engine.failure or "")
    with pytest.raises(EngineFailedError):
        asyncio.run(engine.generate([req]))
    with pytest.raises(EngineFailedError):
        engine.load_weights(1, {})


def test_requests_the_engine_cannot_serve_are_refused(engine: TorchEngine) -> None:
    too_long = GenerationRequest(
        prompt_ids=[1] * 10, max_new_tokens=engine.config.max_seq_len, sampling=SamplingParams()
    )
    for req in (
        too_long,
        GenerationRequest(prompt_ids=[], max_new_tokens=2, sampling=SamplingParams()),
        GenerationRequest(prompt_ids=[1, 10**6], max_new_tokens=2, sampling=SamplingParams()),
    ):
        with pytest.raises(AstraflowError):
            asyncio.run(engine.generate([req]))
    assert engine.healthy()


def test_our_qwen3_forward_matches_transformers_logits(model_dirs: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[0]).eval()
    fwd = Qwen3Forward(model, slots=4, max_len=32)
    prompts = [[1, 14, 5, 6, 7, 18], [1, 16, 4]]
    steps = [[9, 11, 3], [12, 8, 17]]
    got = [fwd.prefill(prompts, [0, 1])]
    for k in range(3):
        pos = torch.tensor([len(p) + k for p in prompts])
        got.append(fwd.decode_step(torch.tensor([s[k] for s in steps]), pos, pos + 1, int(pos.max()) + 1))
    for row, (prompt, cont) in enumerate(zip(prompts, steps, strict=True)):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt + cont])).logits[0]
        for k in range(4):
            assert torch.allclose(got[k][row], ref[len(prompt) - 1 + k], atol=1e-4)


@pytest.mark.parametrize("loop", LOOPS)
def test_other_architectures_fall_back_to_recomputing_with_transformers(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    from astraflow.engines import qwen3_forward
    from astraflow.engines.runners import HFRecomputeRunner

    monkeypatch.setattr(qwen3_forward, "supports", lambda model: False)
    eng = TorchEngine(str(model_dirs[0]), TorchEngineConfig(max_batch=4, decode_loop=loop), seed=1)
    try:
        assert isinstance(eng.runner, HFRecomputeRunner)
        reqs = [
            GenerationRequest(prompt_ids=p, max_new_tokens=5, sampling=SamplingParams())
            for p in ([1, 14, 5], [1, 14, 5], [1, 18])
        ]
        outs = asyncio.run(eng.generate(reqs))
    finally:
        eng.close()
    for req, out in zip(reqs, outs, strict=True):
        ref = _processed_ref(eng.model, req, out.token_ids)
        assert max(abs(x - y) for x, y in zip(ref, out.logprobs, strict=True)) < 1e-4

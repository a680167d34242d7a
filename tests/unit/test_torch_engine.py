"""The embedded engine: exact behaviour logprobs, batching of concurrent callers, weight updates
between decode steps (partial rollouts), stop handling and seeded sampling."""

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
from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig, sample_tokens
from astraflow.models.init import init_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("engine")
    return init_model("qwen3", "tiny", root / "a", seed=0), init_model("qwen3", "tiny", root / "b", seed=1)


@pytest.fixture
def engine(model_dirs: tuple[Path, Path]) -> Iterator[TorchEngine]:
    eng = TorchEngine(str(model_dirs[0]), TorchEngineConfig(max_batch=16, batch_wait_s=0.02), seed=3)
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
        GenerationRequest(prompt_ids=p, max_new_tokens=8, temperature=t)
        for p, t in zip(prompts, temps, strict=True)
    ]

    async def go() -> list[Any]:
        return await engine.generate(reqs)

    outs = asyncio.run(go())
    for req, out in zip(reqs, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 8
        assert out.finish_reason == "length" and out.versions == [0] * 8
        ref = _full_logprobs(engine.model, req.prompt_ids, out.token_ids, req.temperature)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_top_p_logprob_is_of_the_renormalised_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # u near 1 picks the last token kept by top_p = 0.7 (tokens 0 and 1 hold 0.8 of the mass).
    tok, lp = sample_tokens(logits, torch.tensor([1.0]), torch.tensor([0.7]), torch.tensor([0.999]))
    assert int(tok) == 1
    assert float(lp) == pytest.approx(float(torch.log(torch.tensor(0.3 / 0.8))), abs=1e-6)
    tok, lp = sample_tokens(logits, torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.999]))
    assert int(tok) == 3 and float(lp) == pytest.approx(float(torch.log(torch.tensor(0.05))), abs=1e-6)


def test_concurrent_callers_share_batches_up_to_max_batch(model_dirs: tuple[Path, Path]) -> None:
    eng = TorchEngine(str(model_dirs[0]), TorchEngineConfig(max_batch=4, batch_wait_s=0.05), seed=0)
    sizes: list[int] = []
    decode = eng._decode

    def recording(batch: list[Any]) -> None:
        sizes.append(len(batch))
        decode(batch)

    eng._decode = recording  # type: ignore[method-assign]

    async def one(i: int) -> Any:
        return (await eng.generate([GenerationRequest(prompt_ids=[1, 14, 5 + i % 10], max_new_tokens=3)]))[0]

    async def many() -> list[Any]:
        return await asyncio.gather(*(one(i) for i in range(10)))

    try:
        outs = asyncio.run(many())
    finally:
        eng.close()
    assert len(outs) == 10 and all(len(o.token_ids) == 3 for o in outs)
    assert sum(sizes) == 10 and max(sizes) <= 4
    assert len(sizes) == 3  # 10 concurrent requests in batches of 4, 4, 2
    assert eng.capacity() == 4


def test_stop_ids_end_a_sequence_and_are_kept(engine: TorchEngine) -> None:
    async def go() -> list[Any]:
        # Every token is a stop token, so each sequence ends after one step.
        reqs = [GenerationRequest(prompt_ids=[1, 14, 5], max_new_tokens=5, stop_ids=list(range(19)))]
        reqs.append(GenerationRequest(prompt_ids=[1, 14, 6], max_new_tokens=5))
        return await engine.generate(reqs)

    stopped, full = asyncio.run(go())
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1
    assert full.finish_reason == "length" and len(full.token_ids) == 5


def test_seeded_requests_reproduce_regardless_of_batch_mates(engine: TorchEngine) -> None:
    req = GenerationRequest(prompt_ids=[1, 14, 5, 6, 18], max_new_tokens=6, seed=42)

    async def alone() -> Any:
        return (await engine.generate([req]))[0]

    async def crowded() -> Any:
        others = [GenerationRequest(prompt_ids=[1, 15, 9], max_new_tokens=3) for _ in range(5)]
        return (await engine.generate([*others, req]))[-1]

    a, b = asyncio.run(alone()), asyncio.run(crowded())
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_weights_change_mid_sequence_and_later_tokens_carry_the_new_version(
    engine: TorchEngine, model_dirs: tuple[Path, Path]
) -> None:
    new = _weights(model_dirs[1])
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    forward = engine.model.forward
    calls = {"n": 0}

    def staging_forward(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            # Staged while the third decode step runs: applies at the safe point after it.
            engine.load_weights(1, new)
        return forward(*args, **kwargs)

    engine.model.forward = staging_forward  # type: ignore[method-assign]
    prompt = [1, 14, 5, 6, 7, 18]

    async def go() -> Any:
        return (await engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=7)]))[0]

    out = asyncio.run(go())
    engine.model.forward = forward  # type: ignore[method-assign]
    assert out.versions == [0, 0, 0, 1, 1, 1, 1]
    assert engine.version == 1
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], new["model.norm.weight"])
    # Tokens before the switch are the old model's, tokens after it the new model's, exactly.
    engine.model.load_state_dict(old)
    before = _full_logprobs(engine.model, prompt, out.token_ids)[:3]
    engine.model.load_state_dict(new)
    after = _full_logprobs(engine.model, prompt, out.token_ids)[3:]
    assert max(abs(a - b) for a, b in zip(before + after, out.logprobs, strict=True)) < 1e-4


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
    with pytest.raises(KeyError):
        engine.load_weights(7, {"no.such.weight": torch.zeros(1)})


def test_closed_engine_refuses_work(model_dirs: tuple[Path, Path]) -> None:
    eng = TorchEngine(str(model_dirs[0]), seed=0)
    eng.close()

    async def go() -> Any:
        return await eng.generate([GenerationRequest(prompt_ids=[1, 14], max_new_tokens=2)])

    with pytest.raises(RuntimeError):
        asyncio.run(go())

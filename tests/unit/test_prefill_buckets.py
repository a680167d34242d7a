"""Prefill buckets (engines/prefill_graphs.py) on the CPU: which shapes pad to which bucket, and that
a prefill padded to its bucket (what a GPU's prefill graph replays) gives the unpadded prefill's
logits and KV, touching no slot but the prompts' own and the cache's scratch slot."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch

from astraflow.engines.prefill_graphs import MAX_ROWS, MAX_TOKENS, bucket
from astraflow.engines.qwen3_forward import Qwen3Forward
from astraflow.engines.runners import CachedRunner
from astraflow.models.init import init_model

torch.set_num_threads(1)

SLOTS, MAX_LEN = 8, 40


def test_bucket_rounds_rows_and_width_up_and_leaves_big_shapes_eager() -> None:
    assert bucket(1, 2, 512) == (1, 16)
    assert bucket(3, 17, 512) == (4, 32)
    assert bucket(5, 16, 512) == (8, 16)
    assert bucket(16, 256, 512) == (16, 256)
    assert bucket(2, 18, 20) == (2, 21)  # no wider than the cache's max_len + 1 positions
    assert bucket(1, 22, 20) is None  # longer than the cache holds: its own shape
    assert bucket(MAX_ROWS + 1, 4, 512) is None
    assert bucket(32, 129, 4096) is None  # 32 x 256 padded tokens > MAX_TOKENS
    assert bucket(1, MAX_TOKENS, 8192) == (1, MAX_TOKENS)
    assert bucket(1, MAX_TOKENS + 1, 8192) is None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> object:
    from transformers import AutoModelForCausalLM

    path: Path = init_model("qwen3", "tiny", tmp_path_factory.mktemp("pb") / "m", seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _fill_random(fw: Qwen3Forward) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fw.cache.k.copy_(torch.randn(fw.cache.k.shape, generator=g))
    fw.cache.v.copy_(torch.randn(fw.cache.v.shape, generator=g))
    return fw.cache.k.clone(), fw.cache.v.clone()


def test_a_padded_prefill_gives_the_unpadded_logits_and_kv_and_touches_only_scratch(model: object) -> None:
    fw = Qwen3Forward(model, SLOTS, MAX_LEN)
    assert fw.cache.slots == SLOTS and fw.cache.k.shape[1] == SLOTS + 1 and fw.cache.scratch_slot == SLOTS
    prompts = [[1, 5, 9, 4, 7], [1, 12], [1, 8, 8, 3, 2, 6, 11]]
    slots = [5, 0, 3]
    k0, v0 = _fill_random(fw)
    want = fw.prefill(prompts, slots)
    k_want, v_want = fw.cache.k.clone(), fw.cache.v.clone()
    fw.cache.k.copy_(k0)
    fw.cache.v.copy_(v0)
    shape = bucket(len(prompts), 7, MAX_LEN)
    assert shape == (4, 16)
    got = fw.prefill(prompts, slots, shape)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    for p, s in zip(prompts, slots, strict=True):
        for cache, ref in ((fw.cache.k, k_want), (fw.cache.v, v_want)):
            assert torch.allclose(cache[:, s, :, : len(p)], ref[:, s, :, : len(p)], atol=1e-5, rtol=1e-5)
        # the padding positions' garbage stays inside the bucket's width of the prompt's own slot
        assert torch.equal(fw.cache.k[:, s, :, 16:], k0[:, s, :, 16:])
    others = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(fw.cache.k[:, others], k0[:, others])
    assert torch.equal(fw.cache.v[:, others], v0[:, others])
    # the padding prompt wrote its keys into the scratch slot, at the bucket's width
    assert not torch.equal(fw.cache.k[:, SLOTS, :, :16], k0[:, SLOTS, :, :16])
    assert torch.equal(fw.cache.k[:, SLOTS, :, 16:], k0[:, SLOTS, :, 16:])


def test_the_runner_pads_to_the_bucket_when_asked_and_its_logits_stay_the_unpadded_ones(
    model: object,
) -> None:
    runner = CachedRunner(model, SLOTS, MAX_LEN, graphs=True, kernels="auto")
    assert runner.prefill_graphs is None and not runner.pad_prefill  # graphs (and padding) on a GPU
    runner.pad_prefill = True
    fw = runner.forward
    k0, _ = _fill_random(fw)
    prompts = [[1, 4, 6], [1, 9, 2, 2], [1, 3]]
    got = runner.prefill(prompts, [2, 1, 7])
    assert got.shape == (3, fw.vocab)
    # rows 3 of 4 were a padding prompt: the scratch slot is written, up to the 16-wide bucket
    assert not torch.equal(fw.cache.k[:, SLOTS, :, :16], k0[:, SLOTS, :, :16])
    for i, p in enumerate(prompts):
        alone = fw.prefill([p], [4])
        assert torch.allclose(got[i], alone[0], atol=1e-5, rtol=1e-5)


def test_an_engine_with_padded_prefills_samples_what_the_unpadded_engine_samples(tmp_path: Path) -> None:
    """The whole engine (admissions, a group prompt prefilled once and shared, decode steps)
    over padded prefills, as a GPU's prefill graphs run it: the same seeded completions as unpadded."""
    import asyncio

    from astraflow.engines.base import GenerationRequest
    from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig
    from astraflow.protocol.messages import SamplingParams

    path = init_model("qwen3", "tiny", tmp_path / "m", seed=2)
    # the first admission: 6 distinct prompts (a group of 3 among them) in 8 slots, padded to 8 rows
    reqs = [
        GenerationRequest(
            prompt_ids=[1, 3 + i, 7, 2 + i % 3, 9][: 2 + i % 4],
            max_new_tokens=8 + i % 5,
            seed=40 + i,
            sampling=SamplingParams(top_k=6) if i % 4 == 0 else SamplingParams(),
        )
        for i in range(5)
    ]
    reqs += [GenerationRequest(prompt_ids=[1, 4, 4], max_new_tokens=9, seed=90 + i) for i in range(3)]
    reqs += [GenerationRequest(prompt_ids=[1, 10 + i, 5], max_new_tokens=6, seed=70 + i) for i in range(5)]
    outs = []
    for pad in (False, True):
        eng = TorchEngine(str(path), TorchEngineConfig(max_batch=8, max_seq_len=48), seed=5)
        eng.runner.pad_prefill = pad
        scratch = eng.runner.forward.cache.k[:, eng.runner.forward.cache.scratch_slot]
        scratch.fill_(7.0)  # the pad token's embedding is zero: a padding prompt writes zero keys
        try:
            outs.append(asyncio.run(eng.generate(reqs)))
        finally:
            eng.close()
        assert bool((scratch != 7.0).any()) == pad  # padding prompts ran only when padding
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4

"""The overlapped loop's step inputs kept as arrays (`_Batch`): the keys computed in uint64 arrays equal
the exact integer formula, and the arrays advanced by one a step equal what each row says at every step
of a random run (admissions mid-run, stop tokens, rows finishing and moving slots). Real random-init
Qwen3 model on CPU."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import random
from typing import Any

import numpy as np
import pytest
import torch

from astraflow.engines.base import GenerationRequest
from astraflow.engines.overlap_loop import OverlapDecodeLoop
from astraflow.engines.runners import CachedRunner
from astraflow.engines.sampler import seed_words, step_keys, step_seeds
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams

torch.set_num_threads(1)


def _exact(seed: int, counter: int) -> int:
    return (seed * 0x9E3779B1 + counter * 0x85EBCA77 + 1) & ((1 << 62) - 1)


def test_keys_in_arrays_equal_the_integer_formula() -> None:
    rng = random.Random(3)
    seeds = [rng.getrandbits(62) for _ in range(500)] + [
        0,
        1,
        (1 << 62) - 1,
        (1 << 64) - 1,
        1 << 70,
        -1,
        -(1 << 40),
    ]
    counters = [rng.randrange(0, 1 << 20) for _ in seeds]
    keys = step_seeds(seeds, counters)
    assert keys.dtype == torch.int64
    assert keys.tolist() == [_exact(s, c) for s, c in zip(seeds, counters, strict=True)]
    again = step_keys(seed_words(seeds), np.asarray(counters, dtype=np.uint64) + np.uint64(1))
    assert again.tolist() == [_exact(s, c + 1) for s, c in zip(seeds, counters, strict=True)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    path = init_model("qwen3", "tiny", tmp_path_factory.mktemp("batch") / "m", seed=0)
    return AutoModelForCausalLM.from_pretrained(path).eval().requires_grad_(False)


def test_the_kept_step_inputs_follow_the_rows(model: Any) -> None:
    rng = random.Random(7)
    loop: OverlapDecodeLoop[int] = OverlapDecodeLoop(
        CachedRunner(model, 12, 96, graphs=False, kernels="torch"),
        model.state_dict(),
        torch.device("cpu"),
        12,
    )
    vocab = int(model.config.vocab_size)
    tag, done, kept_steps = 0, 0, 0
    for step in range(160):
        if loop.free and rng.random() < 0.3:
            batch = []
            for _ in range(rng.randint(1, loop.free)):
                prompt = [1] + [rng.randrange(2, vocab) for _ in range(rng.randint(1, 5))]
                sampling = SamplingParams(temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 5]))
                stop = [rng.randrange(2, vocab)]
                req = GenerationRequest(prompt, rng.randint(1, 40), sampling, stop, seed=rng.getrandbits(62))
                batch.append((req, tag))
                tag += 1
            done += len(loop.admit(batch))
        b = loop._batch
        if b is not None and loop.rows:
            kept_steps += 1
            want = loop._rebuild()
            assert b.n == want.n
            assert b.positions.tolist() == want.positions.tolist(), step
            assert b.counters.tolist() == want.counters.tolist(), step
            assert b.seeds.tolist() == want.seeds.tolist(), step
            assert b.params == want.params, step
        done += len(loop.step())
    while loop.rows:
        done += len(loop.step())
    assert done == tag
    assert kept_steps > 50  # the kept arrays were in use, not rebuilt every step

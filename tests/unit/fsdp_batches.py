"""Batches and policy shared by test_fsdp.py and the ranks it starts (fsdp_ranks.py)."""

from __future__ import annotations

import random
from pathlib import Path

from astraflow.config.recipe import OptimizerConfig, PolicyConfig
from astraflow.protocol.messages import SamplingParams, TrainSample


def policy(model_dir: Path) -> PolicyConfig:
    """GRPO with two micro-batches per rank (gradient accumulation under sharding)."""
    return PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.01),
        trainer_options={"micro_batch": 2},
    )


def batch(seed: int, n: int = 8) -> list[TrainSample]:
    """Sequences of different lengths with per-sequence sampling settings."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(2, 6))]
        gen = [rng.randrange(4, 19) for _ in range(rng.randrange(1, 7))]
        out.append(
            TrainSample(
                traj_id=i,
                tokens=prompt + gen,
                loss_mask=[0] * len(prompt) + [1] * len(gen),
                logprobs=[0.0] * len(prompt) + [-2.5] * len(gen),
                versions=[-1] * len(prompt) + [0] * len(gen),
                reward=rng.random(),
                advantage=rng.uniform(-1, 1),
                sampling=SamplingParams(temperature=rng.choice([1.0, 0.8])),
            )
        )
    return out

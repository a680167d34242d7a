"""What padding costs the trainer on long-tailed lengths: one trainer, the same batches, micro-batches
taken in arrival order (the baseline, reimplemented here) against the trainer's own plan (in order of
length, trainers/packing.py), alternating. Prints each side's median step and padded token slots a
step beside the real tokens.

    python scripts/trainer_padding.py [--model DIR] [--batch 128] [--micro-batch 32] [--median 24] [--sigma 1.0]

Without --model a random-init tiny Qwen3 is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def arrival_plan(samples: list[Any], *, micro_batch: int, **_: Any) -> list[list[int]]:
    """The baseline: `micro_batch` sequences at a time in the order they came."""
    return [list(range(i, min(i + micro_batch, len(samples)))) for i in range(0, len(samples), micro_batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--median", type=int, default=24, help="median generated tokens (lognormal)")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch

    from astraflow.config.recipe import OptimizerConfig, PolicyConfig
    from astraflow.models.init import init_model
    from astraflow.protocol.messages import SamplingParams, TrainSample
    from astraflow.trainers import packing
    from astraflow.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    model = args.model or init_model("qwen3", "tiny", Path(tempfile.mkdtemp()) / "tiny", seed=0)
    rng = random.Random(0)

    def batch() -> list[TrainSample]:
        out = []
        for i in range(args.batch):
            g = max(1, min(args.cap, round(rng.lognormvariate(math.log(args.median), args.sigma))))
            prompt = [1, 5, 6, 7]
            out.append(
                TrainSample(
                    traj_id=i,
                    tokens=prompt + [rng.randrange(4, 19) for _ in range(g)],
                    loss_mask=[0] * len(prompt) + [1] * g,
                    logprobs=[0.0] * len(prompt) + [-2.5] * g,
                    versions=[-1] * len(prompt) + [0] * g,
                    reward=0.0,
                    advantage=rng.uniform(-1, 1),
                    sampling=SamplingParams(),
                )
            )
        return out

    options = {"micro_batch": args.micro_batch}
    trainer = TorchTrainer(
        PolicyConfig(model=str(model), optimizer=OptimizerConfig(lr=1e-6), trainer_options=options)
    )
    batches = [batch() for _ in range(args.batches)]
    real = sum(s.length for b in batches for s in b) / len(batches)
    own = packing.plan
    for rnd in range(args.rounds):
        for name, plan in (("arrival order (baseline)", arrival_plan), ("in order of length", own)):
            packing.plan = plan  # type: ignore[assignment]
            times, slots = [], 0
            for b in batches:
                groups = plan(b, micro_batch=args.micro_batch, micro_batch_tokens=0)
                slots += sum(len(g) * max(b[i].length for i in g) for g in groups)
                t = time.perf_counter()
                trainer.step(b)
                times.append(time.perf_counter() - t)
            print(
                f"round {rnd + 1}  {name:<24}  median step {statistics.median(times):.3f} s  "
                f"padded token slots a step {slots / len(batches):,.0f}  (real tokens {real:,.0f})"
            )
    packing.plan = own


if __name__ == "__main__":
    main()

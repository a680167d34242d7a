"""What padding costs the trainer on long-tailed lengths: one trainer, the same batches, micro-batches
taken in arrival order (the baseline, reimplemented here) against the trainer's own plan (in order of
length, trainers/packing.py), alternating. Prints each side's median step and padded token slots a
step beside the real tokens.

    python scripts/trainer_padding.py [--model DIR] [--batch 128] [--micro-batch 32] [--median 24] [--sigma 1.0]
        [--group-size 1] [--option KEY=VALUE ...] [--own-only]

Without --model a random-init tiny Qwen3 is written to a temporary directory. The trainer runs where
its device resolves (a GPU when there is one). `--group-size G` draws one length for each G sequences
in a row (as a group of attempts at one problem shares its budget in `collab`); `--option` sets a
trainer option (a JSON value, else the text: `--option dtype=bfloat16 --option compile=true`);
`--own-only` times the trainer's own plan alone (for options, such as packing, that the arrival-order
baseline does not model).
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--group-size", type=int, default=1, help="sequences that share one drawn length")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a trainer option")
    ap.add_argument("--own-only", action="store_true", help="time the trainer's own plan alone")
    args = ap.parse_args()
    options: dict[str, Any] = {"micro_batch": args.micro_batch}
    for item in args.option:
        key, sep, text = item.partition("=")
        if not sep:
            ap.error(f"--option takes KEY=VALUE, not {item!r}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text

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
        g = 0
        for i in range(args.batch):
            if i % max(1, args.group_size) == 0:
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

    trainer = TorchTrainer(
        PolicyConfig(model=str(model), optimizer=OptimizerConfig(lr=1e-6), trainer_options=options)
    )
    batches = [batch() for _ in range(args.batches)]
    real = sum(s.length for b in batches for s in b) / len(batches)
    own = packing.plan
    arms = [("arrival order (baseline)", arrival_plan), ("the trainer's own plan", own)]
    tokens = int(options.get("micro_batch_tokens", 0))
    print(f"device {trainer.device}, options {options}", flush=True)
    for rnd in range(args.rounds):
        for name, plan in arms[1:] if args.own_only else arms:
            packing.plan = plan  # type: ignore[assignment]
            times, slots = [], 0
            for b in batches:
                groups = plan(b, micro_batch=args.micro_batch, micro_batch_tokens=tokens)
                slots += sum(len(g) * max(b[i].length for i in g) for g in groups)
                t = time.perf_counter()
                trainer.step(b)
                times.append(time.perf_counter() - t)
            print(
                f"round {rnd + 1}  {name:<24}  median step {statistics.median(times):.3f} s  "
                f"padded token slots a step {slots / len(batches):,.0f}  (real tokens {real:,.0f})",
                flush=True,
            )
    packing.plan = own


if __name__ == "__main__":
    main()

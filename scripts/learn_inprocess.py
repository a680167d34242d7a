"""Run the quickstart RL loop in one process, to tune how fast a random-init model learns.

dataset -> engine.generate (group_size samples per prompt) -> rewards -> group advantages ->
TrainSamples -> trainer.step -> engine.load_weights, printing the mean reward of every step.

    .venv/bin/python scripts/learn_inprocess.py --seeds 0 1 2

The defaults are the quickstart recipe's settings (recipes/quickstart/recipe.toml).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class LocalClient:
    """An in-process PolicyClient over a TorchEngine."""

    def __init__(self, policy: str, engine: Any, tokenizer: Any, sampling: Any) -> None:
        self.policy = policy
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling

    async def generate(self, prompt_ids: list[int], n: int = 1, **overrides: Any) -> list[Any]:
        from astraflow.engines.base import GenerationRequest

        opts = {
            "max_new_tokens": self.sampling.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "stop_ids": [self.tokenizer.eos_token_id],
        }
        opts.update(overrides)
        return await self.engine.generate(
            [GenerationRequest(prompt_ids=list(prompt_ids), **opts) for _ in range(n)]
        )


def run(args: argparse.Namespace, seed: int, workdir: Path) -> dict[str, float]:
    """One learning run; returns its summary."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from astraflow.config.recipe import OptimizerConfig, PolicyConfig, SamplingConfig
    from astraflow.dataflow.advantages import group_advantages
    from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig
    from astraflow.models.init import init_model
    from astraflow.protocol.messages import TrainSample
    from astraflow.trainers.torch_trainer import TorchTrainer
    from astraflow.workflows.quickstart.workflow import QuickstartConfig, QuickstartWorkflow

    if args.dims:
        import dataclasses

        from astraflow.models import init as model_init

        h, layers, heads, kv, hd, inter = (int(x) for x in args.dims.split(","))
        base = model_init.PRESETS["qwen3"][args.preset]
        model_init.PRESETS["qwen3"][args.preset] = dataclasses.replace(
            base, hidden=h, layers=layers, heads=heads, kv_heads=kv, head_dim=hd, intermediate=inter
        )
    model_dir = init_model("qwen3", args.preset, workdir / f"model-{seed}", seed=seed)
    policy = PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup_steps=args.warmup,
            betas=(0.9, args.beta2),
            grad_clip=args.clip,
        ),
        sampling=SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens),
        group_size=args.group_size,
        batch_prompts=args.batch_prompts,
        advantage=args.advantage,
        loss=args.loss,
    )
    wf = QuickstartWorkflow(QuickstartConfig(task=args.task, length=args.length, reward=args.reward))
    data = list(wf.dataset(seed))
    rng = random.Random(seed)
    engine = TorchEngine(str(model_dir), TorchEngineConfig(max_batch=args.max_batch), seed=seed)
    trainer = TorchTrainer(policy, seed=seed)
    client = LocalClient("main", engine, AutoTokenizer.from_pretrained(model_dir), policy.sampling)
    rewards: list[float] = []
    correct: list[float] = []
    t0 = time.perf_counter()
    traj = 0
    published: list[tuple[int, dict[str, Any]]] = []

    async def rollout(samples: list[dict[str, Any]]) -> list[list[Any]]:
        groups = [[wf.run_episode(s, {"actor": client}) for _ in range(args.group_size)] for s in samples]
        flat = await asyncio.gather(*(ep for g in groups for ep in g))
        return [list(flat[i : i + args.group_size]) for i in range(0, len(flat), args.group_size)]

    for step in range(1, args.steps + 1):
        samples = [data[rng.randrange(len(data))] for _ in range(args.batch_prompts)]
        groups = asyncio.run(rollout(samples))
        batch = []
        for episodes in groups:
            seqs = [ep.sequences[0] for ep in episodes]
            advs = group_advantages([s.reward for s in seqs], policy.advantage)
            for s, a in zip(seqs, advs, strict=True):
                traj += 1
                batch.append(
                    TrainSample(
                        traj_id=traj,
                        tokens=s.tokens,
                        loss_mask=s.loss_mask,
                        logprobs=s.logprobs,
                        versions=s.versions,
                        reward=s.reward,
                        advantage=a,
                    )
                )
            correct.extend(ep.info["correct"] for ep in episodes)
        metrics = trainer.step(batch)
        # --lag k rolls out with weights k versions old, like an asynchronous run at that staleness.
        published.append((trainer.step_count, trainer.export_weights()))
        if len(published) > args.lag:
            version, weights = published.pop(0)
            engine.load_weights(version, weights)
            engine.wait_version(version, timeout=60)
        rewards.append(metrics["reward_mean"])
        acc = sum(correct[-len(batch) :]) / len(batch)
        if not args.quiet:
            print(
                f"seed {seed} step {step:3d} reward {metrics['reward_mean']:.3f} exact {acc:.3f} "
                f"entropy {metrics['entropy']:.3f} grad {metrics['grad_norm']:.3f} "
                f"t {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    engine.close()
    elapsed = time.perf_counter() - t0
    tail = max(1, args.steps // 10)
    first_hit = next(
        (i + 1 for i in range(len(rewards)) if sum(rewards[max(0, i - 4) : i + 1]) / min(5, i + 1) >= 0.8), -1
    )
    return {
        "seed": seed,
        "random_level": rewards[0],
        "last_tenth": sum(rewards[-tail:]) / tail,
        "exact_last_tenth": sum(correct[-tail * len(batch) :]) / (tail * len(batch)),
        "steps_to_0.8_avg5": first_hit,
        "seconds": elapsed,
        "s_per_step": elapsed / args.steps,
    }


def main() -> int:
    """Parse arguments, run every seed, print one summary line per seed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--task", default="copy")
    p.add_argument("--length", type=int, default=2)
    p.add_argument("--reward", default="partial")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.2)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--batch-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--advantage", default="grpo")
    p.add_argument("--loss", default="grpo")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--dims", default="", help="override the preset: hidden,layers,heads,kv_heads,head_dim,inter"
    )
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--lag", type=int, default=0, help="roll out with weights this many versions old")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(args, seed, Path(tmp)) for seed in args.seeds]
    for r in results:
        print(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

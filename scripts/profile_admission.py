"""Where an admission's time goes in the embedded engine: the runner and both decode loops built as
TorchEngine builds them (Qwen3 cached forward, CUDA graphs for decode on a GPU), 240 rows decoding,
then twelve admissions of one GRPO group each, every figure synchronised; then each piece alone and
a torch.profiler table of one admission (docs/benchmarks.md, "an admission costs ten decode steps").

    python scripts/profile_admission.py MODEL_DIR [cuda:0|cpu]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from astraflow.engines.base import GenerationRequest
from astraflow.engines.decode_loop import DecodeLoop
from astraflow.engines.overlap_loop import OverlapDecodeLoop
from astraflow.engines.runners import CachedRunner

SLOTS = 256
GROUP = 16


def main(model_dir: str, device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    vocab = int(model.config.vocab_size)
    runner = CachedRunner(model, SLOTS, 512, graphs=True, kernels="auto")
    params = model.state_dict()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def group(g: int) -> list[tuple[GenerationRequest, Any]]:
        prompt = [(3 + g) % vocab, (5 + 7 * g) % vocab]  # two tokens, as recipes/gpu/single.toml's
        return [(GenerationRequest(prompt, 400, seed=g * 100 + i), (g, i)) for i in range(GROUP)]

    def end_newest(loop: DecodeLoop[Any]) -> None:
        for r in loop.rows[-GROUP:]:
            r.finish_reason = "length"  # the newest group ends: its slots free for the next admission
        loop.step()
        loop.step()
        sync()

    for cls in (OverlapDecodeLoop, DecodeLoop):
        loop: DecodeLoop[Any] = cls(runner, params, dev, SLOTS)
        g = 0
        for _ in range(SLOTS // GROUP - 1):
            loop.admit(group(g))
            g += 1
        for _ in range(20):
            loop.step()
        sync()
        admits, steps = [], []
        for _ in range(12):
            t = time.perf_counter()
            loop.admit(group(g))
            g += 1
            sync()
            admits.append(round((time.perf_counter() - t) * 1e3, 2))
            t = time.perf_counter()
            for _ in range(5):
                loop.step()
            sync()
            steps.append(round((time.perf_counter() - t) * 1e3 / 5, 2))
            end_newest(loop)
        print(f"{cls.__name__}: admitting a group of {GROUP}, ms: {admits}")
        print(f"  a decode step over {len(loop.rows) + GROUP}-ish rows, ms: {steps}")
        pieces: list[tuple[str, Callable[[], Any]]] = [
            ("prefill of 1 prompt", lambda: runner.prefill([[7, 11]], [SLOTS - 1])),
            (
                "prefill of 9 prompts",
                lambda: runner.prefill([[7, 1 + j] for j in range(9)], list(range(240, 249))),
            ),
            ("KV copy into 15 slots", lambda: runner.copy_slot(240, list(range(241, SLOTS)), 2)),
        ]
        for name, fn in pieces:
            for _ in range(3):
                fn()
            sync()
            t = time.perf_counter()
            for _ in range(10):
                fn()
            sync()
            print(f"  {name}: {(time.perf_counter() - t) * 100:.2f} ms")
        end_newest(loop)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            loop.admit(group(g))
            sync()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda:0")

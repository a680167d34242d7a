"""Where a decode step's GPU time goes in the embedded engine at the shapes `bench e2e` runs: the runner
built as TorchEngine builds it (Qwen3 cached forward, CUDA graphs, Triton kernels), every row at one
cached length, every figure synchronised and averaged over many steps:

- the graph replay of one decode forward at several batch sizes and cached lengths;
- the fused sampler over that forward's logits; the LM head alone;
- a full step of the overlapped decode loop with 256 rows decoding;
- a torch.profiler table of the eager forward's kernels (the same kernels the graph replays, without
  the graph's launch savings), grouped by kernel name.

    python scripts/profile_decode.py MODEL_DIR [cuda:0]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from astraflow.engines.base import GenerationRequest
from astraflow.engines.overlap_loop import OverlapDecodeLoop
from astraflow.engines.runners import CachedRunner
from astraflow.engines.sampler import Sampler
from astraflow.protocol.messages import SamplingParams

SLOTS = 512
MAX_LEN = 512


def timed(fn: Callable[[], Any], dev: torch.device, reps: int = 50) -> float:
    """Milliseconds per call, synchronised, after a warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t) * 1e3 / reps


def main(model_dir: str, device: str) -> None:
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    vocab = int(model.config.vocab_size)
    runner = CachedRunner(model, SLOTS, MAX_LEN, graphs=True, kernels="auto")
    fwd = runner.forward
    sampler = Sampler(dev, use_triton=runner.uses_triton)
    plain = SamplingParams(temperature=1.0)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton ops: {runner.uses_triton}")

    print("graph replay of one decode forward, ms (rows x cached length)")
    for ctx in (66, 130, 300):
        cells = []
        for n in (64, 128, 256, 384, 512):
            toks, pos = [1] * n, [ctx] * n
            cells.append(f"{n}: {timed(lambda t=toks, q=pos: runner.decode(t, q), dev):.3f}")
        print(f"  ctx {ctx}: " + "  ".join(cells))

    for n in (256, 512):
        logits = runner.decode([1] * n, [66] * n).clone()
        params, seeds, counters = [plain] * n, list(range(n)), [0] * n
        s = timed(lambda a=(logits, params, seeds, counters): sampler.sample_on_device(*a), dev)
        h = torch.randn(n, fwd.embed.shape[1], device=dev, dtype=torch.bfloat16)
        head = timed(lambda x=h: F.linear(x, fwd.lm_head), dev)
        print(f"rows {n}: fused sampling {s:.3f} ms; LM head alone {head:.3f} ms (logits {logits.dtype})")

    for n in (256,):
        loop: OverlapDecodeLoop[Any] = OverlapDecodeLoop(runner, model.state_dict(), dev, SLOTS)
        for g in range(n // 16):
            prompt = [(3 + g) % vocab, (5 + 7 * g) % vocab]
            loop.admit([(GenerationRequest(prompt, 400, seed=g * 100 + i), (g, i)) for i in range(16)])
        for _ in range(60):
            loop.step()
        step = timed(loop.step, dev, reps=100)
        print(
            f"overlapped loop, {len(loop.rows)} rows at about {loop.rows[0].cached} cached: {step:.3f} ms a step"
        )

    n, ctx = 256, 66
    t = torch.ones(n, dtype=torch.long, device=dev)
    p = torch.full((n,), ctx, dtype=torch.long, device=dev)
    eager = lambda: fwd.decode_step(t, p, p + 1, ctx + 1, runner.ops)  # noqa: E731
    print(f"eager forward, {n} rows at {ctx}: {timed(eager, dev):.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eager()
        torch.cuda.synchronize(dev)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda:0")

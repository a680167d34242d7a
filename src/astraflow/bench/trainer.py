"""`astraflow bench trainer`: the trainer's step against a bare transformers step on the same tokens.

Both sides see the same synthetic batch (random tokens, `prompt_len` of each sequence untrained) and
run forward, backward and AdamW. The trainer runs its full objective (GRPO by default) through its
own path (chunked logprobs, packing, FSDP2 under torchrun); the baseline is `model(input_ids,
labels=...)` + backward + AdamW.step with transformers' own loss, at the largest micro-batch (a
power-of-two fraction of the batch) that fits. MFU = model FLOPs / step time / peak, model FLOPs =
(4 x parameters + 2 x trained parameters) x tokens: 2N forward, 2N for the activation gradients, 2N
for the weight gradients of trained weights only, so 6N per token when every weight trains (LoRA: about
4N). N counts every parameter, the output embedding included; attention's score FLOPs are not counted
(the usual 6N convention; they add about 20% real work at 2,048 tokens on the 0.6B shape), nor is the
logits recomputation of the chunked logprobs.
Under torchrun every rank trains its own `batch` sequences (weak scaling) and the baseline is skipped.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.protocol import packed

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 tensor-core peaks (no sparsity) by card name fragment, TFLOP/s."""


@dataclass
class BenchSide:
    """Measurements of one side (trainer or baseline)."""

    name: str
    step_s: float
    tokens_per_s: float
    mfu: float | None
    peak_mem_gb: float | None
    micro_batch: int | None = None
    note: str = ""


@dataclass
class TrainerBenchResult:
    """Everything `bench trainer` measured."""

    device: str
    params: int
    trained_params: int
    tokens_per_step: int
    ranks: int
    options: dict[str, Any]
    sides: list[BenchSide] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    """The card's dense bf16 peak in FLOP/s (None when unknown, e.g. on CPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    for key, tf in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tf * 1e12
    return None


def synthetic_batch(n: int, seq_len: int, prompt_len: int, vocab: int, seed: int) -> list[Any]:
    """`n` sequences of `seq_len` random tokens, the first `prompt_len` untrained."""
    from astraflow.protocol.messages import SamplingParams, TrainSample

    rng = random.Random(seed)
    gen = seq_len - prompt_len
    out = []
    for i in range(n):
        out.append(
            TrainSample(
                traj_id=i,
                tokens=packed.pack_ints("tokens", [rng.randrange(4, vocab) for _ in range(seq_len)]),
                loss_mask=packed.pack_mask([0] * prompt_len + [1] * gen),
                logprobs=packed.pack_floats("logprobs", [0.0] * prompt_len + [-8.0] * gen),
                versions=packed.pack_ints("versions", [-1] * prompt_len + [0] * gen),
                reward=float(i % 2),
                advantage=1.0 if i % 2 else -1.0,
                sampling=SamplingParams(),
            )
        )
    return out


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: Any) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _timed(fn: Any, device: Any, steps: int, warmup: int) -> float:
    """Median seconds of `fn()` over `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run_trainer_bench(
    model: Path,
    *,
    batch: int,
    seq_len: int,
    prompt_len: int,
    options: dict[str, Any],
    loss: str = "grpo",
    steps: int = 5,
    warmup: int = 2,
    baseline: bool = True,
    device: str = "auto",
    peak_tflops: float | None = None,
) -> TrainerBenchResult:
    """Time the trainer's step (and, on one rank, the bare transformers step) on the same tokens."""
    import torch

    from astraflow.config.recipe import OptimizerConfig, PolicyConfig
    from astraflow.trainers import distributed as dist
    from astraflow.trainers.torch_trainer import TorchTrainer

    if prompt_len >= seq_len:
        raise AstraflowError(
            "--prompt-len must be below --seq-len", hint="e.g. --seq-len 2048 --prompt-len 256"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_from_env(device)
    pol = PolicyConfig(
        model=str(model),
        loss=loss,
        optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
        trainer_options=options,
    )
    trainer: TorchTrainer | None = TorchTrainer(pol, device=device)
    assert trainer is not None
    dev = trainer.device
    vocab = int(trainer.model.config.vocab_size)
    ranks = dist.world()
    # Every rank draws the same global batch; each trains its own share (plan balances by tokens).
    samples = synthetic_batch(batch * ranks, seq_len, prompt_len, vocab, seed=0)
    # A sharded parameter (DTensor) reports its full, unsharded size.
    n_params = sum(p.numel() for p in trainer.model.parameters())
    n_trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = peak_flops(name, peak_tflops)
    tokens = batch * seq_len * ranks
    res = TrainerBenchResult(
        device=f"{ranks} x {name}" if ranks > 1 else name,
        params=n_params,
        trained_params=n_trained,
        tokens_per_step=tokens,
        ranks=ranks,
        options={**options, "batch": batch, "seq_len": seq_len, "prompt_len": prompt_len, "loss": loss},
    )
    _reset_memory(dev)

    def trainer_step() -> None:
        assert trainer is not None
        trainer.step(samples)

    step_s = _timed(trainer_step, dev, steps, warmup)
    flops = (4 * n_params + 2 * n_trained) * tokens
    res.sides.append(_side("astraflow trainer", step_s, tokens, flops, peak, _peak_gb(dev), ranks))
    trainer = None  # free its memory before the baseline loads
    if baseline and ranks == 1:
        res.sides.append(_baseline(model, samples, options, dev, steps, warmup, peak, n_params))
    return res


def _side(
    name: str, step_s: float, tokens: int, flops: float, peak: float | None, mem: float | None, ranks: int
) -> BenchSide:
    mfu = flops / step_s / (peak * ranks) if peak else None
    return BenchSide(name=name, step_s=step_s, tokens_per_s=tokens / step_s, mfu=mfu, peak_mem_gb=mem)


def _baseline(
    model: Path,
    samples: list[Any],
    options: dict[str, Any],
    dev: Any,
    steps: int,
    warmup: int,
    peak: float | None,
    n_params: int,
) -> BenchSide:
    """transformers forward (with labels) + backward + AdamW, largest micro-batch that fits."""
    import torch
    from transformers import AutoModelForCausalLM

    _reset_memory(dev)
    dtype = getattr(torch, options.get("dtype", "float32"))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(dev).train()
    if options.get("gradient_checkpointing"):
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6, weight_decay=0.0)
    ids = torch.tensor([s.token_list() for s in samples], dtype=torch.long, device=dev)
    labels = ids.clone()
    labels[:, : sum(1 for m in samples[0].loss_mask if not m)] = -100
    n = ids.shape[0]
    micro = n
    tokens = ids.numel()
    while True:
        try:

            def step(micro: int = micro) -> None:
                for i in range(0, n, micro):
                    out = lm(input_ids=ids[i : i + micro], labels=labels[i : i + micro], use_cache=False)
                    (out.loss * (min(micro, n - i) / n)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            _reset_memory(dev)
            step_s = _timed(step, dev, steps, warmup)
            break
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            if micro == 1:
                return BenchSide("transformers + AdamW", float("nan"), 0.0, None, None, 1, "out of memory")
            micro = max(1, micro // 2)
    side = _side("transformers + AdamW", step_s, tokens, 6.0 * n_params * tokens, peak, _peak_gb(dev), 1)
    side.micro_batch = micro
    return side


def format_table(res: TrainerBenchResult) -> str:
    """The comparison as a plain-text table, trainer / baseline ratio last."""
    o = res.options
    lines = [
        f"device: {res.device}; {res.params / 1e9:.3f}B parameters ({res.trained_params / 1e9:.3f}B trained); "
        f"{o['batch']} x {o['seq_len']} tokens per rank ({o['prompt_len']} prompt); {res.tokens_per_step} per step",
        f"trainer options: { {k: v for k, v in o.items() if k not in ('batch', 'seq_len', 'prompt_len')} }",
        f"{'side':<22} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'peak GB':>8}  note",
    ]
    for s in res.sides:
        mfu = f"{100 * s.mfu:.1f}%" if s.mfu is not None else "-"
        mem = f"{s.peak_mem_gb:.1f}" if s.peak_mem_gb is not None else "-"
        note = s.note or (f"micro-batch {s.micro_batch}" if s.micro_batch else "")
        lines.append(f"{s.name:<22} {s.step_s:>8.3f} {s.tokens_per_s:>10.0f} {mfu:>7} {mem:>8}  {note}")
    if len(res.sides) == 2 and res.sides[1].tokens_per_s > 0:
        lines.append(
            f"trainer / baseline tokens/s: {res.sides[0].tokens_per_s / res.sides[1].tokens_per_s:.2f}x"
        )
    return "\n".join(lines)

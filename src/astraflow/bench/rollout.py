"""The rollout benchmark: the embedded engine against plain transformers `generate` and the memory bound,
and the engine's two decode loops (synchronous and overlapped) against each other.

Both generators run on the same loaded model (one copy of the weights, same dtype and device) and the
same random prompts of equal length, with temperature 1.0 and no stop token, so every sequence
decodes exactly `new_tokens` tokens. The decode phase is timed on its own: `new_tokens - 1` steps after
the prefill. For HF generate a forward hook on the model marks the end of the first forward (the
prefill); the engine runs its own forward over its KV cache and stamps the end of its prefill itself.

The bound is what one decode step must at least read from memory: every parameter once, plus the
keys and values of every cached position of every row, divided by the bandwidth of a large copy
measured in the same run. It leaves out logits, activations and KV writes, so a real step can never
reach it; what fraction of it a step achieves says how much of the step is memory traffic and how
much is overhead (kernel launches, Python, sampling).

With `loops = ["sync", "overlap"]` one engine per decode loop is loaded (two copies of the weights and
of the KV cache) and both are timed on the same seeded requests; their completions of the warm-up call
are compared token by token and logprob by logprob (`loops_agree`).

Over 400 lines because every generator is timed by the same code on the same prompts,
with the memory bound computed beside them.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError

_log = log.get("bench.rollout")


@dataclass
class GenTiming:
    """Timing of one generator at one batch size (medians over the repeats)."""

    total_s: float
    """Wall time of one whole generate call: prefill plus every decode step."""
    prefill_s: float
    """Time from the call to the end of the first forward (the prompt pass)."""
    ms_per_step: float
    """Milliseconds per decode step after the prefill."""
    decode_tok_s: float
    """Tokens per second of the decode phase: batch * (new_tokens - 1) / decode time."""
    e2e_tok_s: float
    """Tokens per second of the whole call: batch * new_tokens / total time."""
    bound_frac: float
    """The physical lower bound of a decode step divided by the measured step (1.0 = at the bound)."""


@dataclass
class BenchRow:
    """Results at one batch size."""

    batch: int
    """Sequences decoded together."""
    engine: GenTiming
    """The embedded TorchEngine with the first decode loop of `RolloutBench.loops`."""
    hf: GenTiming
    """The baseline: transformers `model.generate` with sampling."""
    ratio: float
    """Engine decode tokens/s divided by the baseline's (above 1: the engine is faster)."""
    bound_ms_per_step: float
    """Lower bound of a decode step: (parameter bytes + mean KV bytes read) / measured bandwidth."""
    kv_bytes_per_step: float
    """Mean bytes of keys and values a decode step reads (the whole batch)."""
    loops: dict[str, GenTiming] = field(default_factory=dict)
    """The engine with each decode loop timed (`engine` is the first of them)."""
    overlap_vs_sync: float | None = None
    """Decode tokens/s of the overlapped loop divided by the synchronous loop's (both timed)."""
    loops_agree: bool | None = None
    """Whether both loops gave the same tokens, logprobs (bit for bit) and versions (both timed)."""
    max_logprob_diff: float | None = None
    """Largest difference between the two loops' logprobs of one token (both timed, same tokens)."""


@dataclass
class RolloutBench:
    """One run of the benchmark: settings, the device's measured bandwidth and a row per batch size."""

    model: str
    """The model directory."""
    device: str
    """torch device the run used."""
    device_name: str
    """The GPU's name, or the CPU's."""
    dtype: str
    """Parameter dtype."""
    prompt_len: int
    """Tokens per prompt."""
    new_tokens: int
    """Tokens generated per sequence."""
    repeats: int
    """Timed calls per generator and batch size (the median is reported), after one warm-up call."""
    threads: int
    """torch CPU threads."""
    loops: list[str]
    """The engine's decode loops timed (engine_options.decode_loop), the reference first."""
    group: int
    """Sequences per prompt (a GRPO group): batch / group distinct prompts, each repeated `group` times."""
    param_bytes: int
    """Bytes of all parameters (tied weights counted once)."""
    kv_bytes_per_token: int
    """Bytes of keys and values one cached position holds, over every layer."""
    bandwidth_gb_s: float
    """Measured memory bandwidth, GB/s (bytes read plus written by a large copy)."""
    torch_version: str
    """torch version."""
    transformers_version: str
    """transformers version."""
    rows: list[BenchRow] = field(default_factory=list)
    """One result per batch size, in the order asked."""

    def to_dict(self) -> dict[str, Any]:
        """The whole result as plain JSON-ready data."""
        return asdict(self)


def parse_batches(spec: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]; every entry a positive integer."""
    try:
        batches = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise AstraflowError(
            f"bad --batch {spec!r}", hint="give positive integers separated by commas, e.g. 1,8,64"
        )
    return batches


def check_model_dir(model: Path) -> None:
    """Fail early, before torch loads, when `model` is not a transformers model directory."""
    if not (model.is_dir() and (model / "config.json").is_file()):
        raise AstraflowError(
            f"no model found at {model} (a directory with config.json)",
            hint="create one with `astraflow model init --arch qwen3 --preset small --out DIR`",
        )


def measure_bandwidth(device: Any, nbytes: int | None = None, repeats: int = 8) -> float:
    """Bytes per second of a large device-memory copy, counting bytes read plus bytes written (best of
    `repeats`)."""
    import torch

    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def param_bytes(model: Any) -> int:
    """Bytes of every distinct parameter tensor (a tied embedding and head count once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys plus values that one cached position holds over all layers."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return int(cfg.num_hidden_layers * 2 * kv_heads * head_dim * elem)


def run_rollout_bench(
    model_dir: Path,
    batches: list[int],
    *,
    prompt_len: int = 32,
    new_tokens: int = 128,
    device: str = "auto",
    dtype: str = "float32",
    repeats: int = 3,
    seed: int = 0,
    threads: int = 1,
    group: int = 1,
    loops: list[str] | None = None,
) -> RolloutBench:
    """Time TorchEngine.generate (with each decode loop of `loops`, default the synchronous one) and
    transformers generate at each batch size on one model."""
    check_model_dir(model_dir)
    loops = loops or ["sync"]
    if not loops or any(k not in ("sync", "overlap") for k in loops) or len(set(loops)) != len(loops):
        raise AstraflowError(f"bad decode loops {loops}", hint="choose sync, overlap or both")
    if group < 1 or any(b % group for b in batches):
        raise AstraflowError(
            f"--group {group} must divide every batch size {batches}",
            hint="a batch holds whole groups: batch / group prompts, each sampled group times",
        )
    if new_tokens < 2 or prompt_len < 1 or repeats < 1:
        raise AstraflowError(
            "the rollout bench needs --new-tokens >= 2, --prompt-len >= 1 and --repeats >= 1",
            hint="the decode phase is timed after the first token, so at least two tokens are generated",
        )
    import torch
    import transformers

    from astraflow.engines.device import resolve_device
    from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig

    torch.set_num_threads(threads)
    dev = resolve_device(device)
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise AstraflowError(
            "--device cuda was asked for but torch sees no GPU",
            hint="use --device cpu (or auto), or install a CUDA build of torch on a machine with a GPU",
        )
    engines = {}
    try:
        for kind in loops:
            config = TorchEngineConfig(
                max_batch=max(batches),
                dtype=dtype,
                batch_wait_s=0.0,
                max_seq_len=prompt_len + new_tokens,
                decode_loop=kind,
            )
            engines[kind] = TorchEngine(str(model_dir), config, seed=seed, device=dev)
        engine = engines[loops[0]]
        model = engine.model
        torch_dev = engine.device
        bw = measure_bandwidth(torch_dev)
        result = RolloutBench(
            model=str(model_dir),
            device=str(torch_dev),
            device_name=_device_name(torch_dev),
            dtype=dtype,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            repeats=repeats,
            threads=threads,
            loops=list(loops),
            group=group,
            param_bytes=param_bytes(model),
            kv_bytes_per_token=kv_bytes_per_token(model),
            bandwidth_gb_s=bw / 1e9,
            torch_version=torch.__version__,
            transformers_version=transformers.__version__,
        )
        _log.info(
            "%s on %s (%s): %.1f MB of parameters, bandwidth %.1f GB/s",
            model_dir,
            result.device,
            result.device_name,
            result.param_bytes / 1e6,
            result.bandwidth_gb_s,
        )
        timer = _FirstForwardTimer(torch_dev)
        handle = model.register_forward_hook(timer.hook)
        loop = asyncio.new_event_loop()
        try:
            for batch in batches:
                row = _bench_batch(engines, loop, timer, batch, result, seed)
                result.rows.append(row)
                _log.info(
                    "batch %d: engine %.0f tok/s, HF generate %.0f tok/s (x%.2f), bound %.2f ms/step",
                    batch,
                    row.engine.decode_tok_s,
                    row.hf.decode_tok_s,
                    row.ratio,
                    row.bound_ms_per_step,
                )
        finally:
            loop.close()
            handle.remove()
    finally:
        for eng in engines.values():
            eng.close()
    return result


class _FirstForwardTimer:
    """A forward hook that records when the first forward of a timed call ends (the prefill)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.armed = False
        self.stamp = 0.0

    def arm(self) -> None:
        """Record the end of the next forward."""
        self.armed = True
        self.stamp = 0.0

    def hook(self, _module: Any, _args: Any, _output: Any) -> None:
        """Forward hook: one synchronisation per timed call, only at its first forward."""
        if self.armed:
            self.armed = False
            _sync(self.device)
            self.stamp = time.perf_counter()


def _bench_batch(
    engines: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
    timer: _FirstForwardTimer,
    batch: int,
    res: RolloutBench,
    seed: int,
) -> BenchRow:
    """Warm up and time every generator at one batch size: the engine with each decode loop, then HF."""
    import torch

    from astraflow.engines.base import GenerationRequest

    engine = engines[res.loops[0]]
    model, dev = engine.model, engine.device
    gen = torch.Generator().manual_seed(seed + batch)
    # Skip the lowest ids, which the model init reserves for special tokens.
    low = min(4, model.config.vocab_size - 1)
    prompts = torch.randint(low, model.config.vocab_size, (batch // res.group, res.prompt_len), generator=gen)
    prompts = prompts.repeat_interleave(res.group, dim=0)
    # Seeded, so every decode loop draws the same noise for the same token and can be compared.
    requests = [
        GenerationRequest(prompt_ids=p.tolist(), max_new_tokens=res.new_tokens, seed=(seed << 24) + i)
        for i, p in enumerate(prompts)
    ]
    input_ids = prompts.to(dev)
    attention_mask = torch.ones_like(input_ids)
    first: dict[str, list[Any]] = {}

    def run_engine(kind: str) -> Any:
        eng = engines[kind]

        def run() -> int:
            eng.timeline = []
            completions = loop.run_until_complete(eng.generate(requests))
            # The engine runs its own forward (the HF hook never fires): it stamps the end of its prefill.
            timer.armed, timer.stamp = False, eng.timeline[0][1]
            eng.timeline = None
            first.setdefault(kind, completions)
            return sum(len(c.token_ids) for c in completions)

        return run

    def run_hf() -> int:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=res.new_tokens,
            min_new_tokens=res.new_tokens,
        )
        return int(out.shape[0] * (out.shape[1] - res.prompt_len))

    torch.manual_seed(seed)
    bound_s, kv_step = _bound(res, batch)
    loops = {kind: _time_generator(run_engine(kind), timer, dev, batch, res, bound_s) for kind in res.loops}
    hf = _time_generator(run_hf, timer, dev, batch, res, bound_s)
    row = BenchRow(
        batch=batch,
        engine=loops[res.loops[0]],
        hf=hf,
        ratio=loops[res.loops[0]].decode_tok_s / hf.decode_tok_s,
        bound_ms_per_step=bound_s * 1e3,
        kv_bytes_per_step=kv_step,
        loops=loops,
    )
    if len(loops) == 2:
        row.overlap_vs_sync = loops["overlap"].decode_tok_s / loops["sync"].decode_tok_s
        row.loops_agree, row.max_logprob_diff = _compare(first["sync"], first["overlap"])
    return row


def _compare(a: list[Any], b: list[Any]) -> tuple[bool, float | None]:
    """(same tokens, logprobs and versions bit for bit; the largest logprob difference, None when the
    tokens differ)."""
    same_tokens = all(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    if not same_tokens:
        return False, None
    diff = max(
        (abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x.logprobs, y.logprobs, strict=True)),
        default=0.0,
    )
    same = diff == 0.0 and all(x.versions == y.versions for x, y in zip(a, b, strict=True))
    return same, diff


def _bound(res: RolloutBench, batch: int) -> tuple[float, float]:
    """(seconds, KV bytes) of the mean decode step at the bound. Decode step k (1..new_tokens-1)
    attends to prompt_len + k positions, so the mean is prompt_len + new_tokens / 2."""
    mean_ctx = res.prompt_len + res.new_tokens / 2
    kv_step = batch * mean_ctx * res.kv_bytes_per_token
    return (res.param_bytes + kv_step) / (res.bandwidth_gb_s * 1e9), kv_step


def _time_generator(
    fn: Any, timer: _FirstForwardTimer, dev: Any, batch: int, res: RolloutBench, bound_s: float
) -> GenTiming:
    """One warm-up call, then the median of `repeats` timed calls, each split at the prefill."""
    want = batch * res.new_tokens
    got = fn()
    if got != want:
        raise RuntimeError(f"generator produced {got} tokens, expected {want}: a stop token ended a sequence")
    totals, prefills = [], []
    for _ in range(res.repeats):
        _sync(dev)
        timer.arm()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        t1 = time.perf_counter()
        totals.append(t1 - t0)
        prefills.append(timer.stamp - t0)
    total = statistics.median(totals)
    decode = statistics.median(t - p for t, p in zip(totals, prefills, strict=True))
    steps = res.new_tokens - 1
    step_s = decode / steps
    return GenTiming(
        total_s=total,
        prefill_s=statistics.median(prefills),
        ms_per_step=step_s * 1e3,
        decode_tok_s=batch * steps / decode,
        e2e_tok_s=batch * res.new_tokens / total,
        bound_frac=bound_s / step_s,
    )


def _sync(device: Any) -> None:
    """Wait for queued GPU work so wall-clock timers measure it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_table(res: RolloutBench) -> str:
    """The result as an aligned text table with a header line of settings."""
    head = (
        f"{res.model} on {res.device} ({res.device_name}), {res.dtype}, prompt {res.prompt_len}, "
        f"new tokens {res.new_tokens}, group {res.group}, median of {res.repeats}, {res.threads} thread(s)\n"
        f"parameters {res.param_bytes / 1e6:.1f} MB, KV {res.kv_bytes_per_token / 1024:.1f} KiB/token, "
        f"measured bandwidth {res.bandwidth_gb_s:.1f} GB/s (copy, read+write); "
        f"engine columns: the {res.loops[0]} decode loop\n"
    )
    both = len(res.loops) == 2
    cols = [
        "batch",
        "engine tok/s",
        "HF tok/s",
        "engine/HF",
        "engine ms/step",
        "HF ms/step",
        "bound ms/step",
        "engine % bound",
        "HF % bound",
        "prefill ms (eng/HF)",
    ]
    if both:
        cols += ["overlap tok/s", "overlap ms/step", "overlap/sync", "loops agree"]
    lines = [
        [
            str(r.batch),
            f"{r.engine.decode_tok_s:.0f}",
            f"{r.hf.decode_tok_s:.0f}",
            f"x{r.ratio:.2f}",
            f"{r.engine.ms_per_step:.3f}",
            f"{r.hf.ms_per_step:.3f}",
            f"{r.bound_ms_per_step:.3f}",
            f"{100 * r.engine.bound_frac:.1f}",
            f"{100 * r.hf.bound_frac:.1f}",
            f"{1e3 * r.engine.prefill_s:.1f}/{1e3 * r.hf.prefill_s:.1f}",
            *(_loop_cells(r) if both else []),
        ]
        for r in res.rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    tail = "\ntok/s: decode phase (after the prefill); bound: (parameters + KV read) / measured bandwidth"
    if both:
        tail += "\nloops agree: same tokens, logprobs and versions bit for bit (else the largest logprob gap)"
    return head + "\n".join(out) + tail


def _loop_cells(r: BenchRow) -> list[str]:
    """The overlapped loop's columns of one row."""
    ov = r.loops["overlap"]
    if r.loops_agree:
        agree = "yes"
    elif r.max_logprob_diff is None:
        agree = "no: tokens differ"
    else:
        agree = f"no: logprobs {r.max_logprob_diff:.1e}"
    return [f"{ov.decode_tok_s:.0f}", f"{ov.ms_per_step:.3f}", f"x{r.overlap_vs_sync:.2f}", agree]

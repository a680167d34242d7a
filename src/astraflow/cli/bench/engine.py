"""`astraflow bench` commands. Benchmarks of one part on one machine: the rollout engine, the trainer, the wire encoding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from astraflow.cli.bench.common import app


@app.command("rollout")
def rollout(
    model: Annotated[
        Path, typer.Option("--model", help="Model directory (e.g. from `astraflow model init`).")
    ],
    batch: Annotated[
        str, typer.Option("--batch", help="Batch sizes to measure, comma-separated.")
    ] = "1,8,64",
    prompt_len: Annotated[int, typer.Option("--prompt-len", min=1, help="Tokens per random prompt.")] = 32,
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", min=2, help="Tokens generated per sequence (no stop token).")
    ] = 128,
    device: Annotated[
        str, typer.Option("--device", help="auto | cpu | cuda (auto: CUDA when visible).")
    ] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Parameter dtype: float32 | bfloat16.")] = "float32",
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats", min=1, help="Timed calls per generator and batch (median), after a warm-up."
        ),
    ] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts and the sampling.")] = 0,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads.")] = 1,
    group: Annotated[
        int,
        typer.Option("--group", min=1, help="Sequences per prompt (GRPO group); must divide each batch."),
    ] = 1,
    decode_loop: Annotated[
        str,
        typer.Option(
            "--loop",
            help="The engine's decode loop: sync | overlap | both (both: timed side by side, with their ratio).",
        ),
    ] = "both",
    json_: Annotated[
        bool, typer.Option("--json", help="Print the result as JSON on stdout (the table goes to stderr).")
    ] = False,
) -> None:
    """Time the embedded engine against transformers generate and the memory-bandwidth bound of a step."""
    import json

    from astraflow import log
    from astraflow.bench.rollout import check_model_dir, format_table, parse_batches, run_rollout_bench
    from astraflow.errors import AstraflowError

    log.setup("bench")
    if device not in ("auto", "cpu", "cuda"):
        raise AstraflowError(f"unknown --device {device!r}", hint="choose auto, cpu or cuda")
    if dtype not in ("float32", "bfloat16"):
        raise AstraflowError(f"unknown --dtype {dtype!r}", hint="choose float32 or bfloat16")
    loops = {"sync": ["sync"], "overlap": ["overlap"], "both": ["sync", "overlap"]}.get(decode_loop)
    if loops is None:
        raise AstraflowError(f"unknown --loop {decode_loop!r}", hint="choose sync, overlap or both")
    batches = parse_batches(batch)
    check_model_dir(model)
    import transformers

    # The baseline's generate warns about sampling flags on every call; keep the output readable.
    transformers.logging.set_verbosity_error()
    res = run_rollout_bench(
        model,
        batches,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        device=device,
        dtype=dtype,
        repeats=repeats,
        seed=seed,
        threads=threads,
        group=group,
        loops=loops,
    )
    typer.echo(format_table(res), err=json_)
    if json_:
        typer.echo(json.dumps(res.to_dict(), indent=2))


@app.command("rollout-stream")
def rollout_stream(
    model: Annotated[
        Path, typer.Option("--model", help="Model directory (e.g. from `astraflow model init`).")
    ],
    rules: Annotated[
        str,
        typer.Option(
            "--rules", help="admit_min_free values to compare, comma-separated (0: the greedy rule)."
        ),
    ] = "0,16",
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="The engine's KV slots.")] = 64,
    group: Annotated[int, typer.Option("--group", min=1, help="Samples per prompt (GRPO group).")] = 16,
    in_flight: Annotated[
        int, typer.Option("--in-flight", min=1, help="Groups queued or running at once (a RaaS's slots).")
    ] = 8,
    groups: Annotated[int, typer.Option("--groups", min=1, help="Groups per timed round.")] = 32,
    prompt_len: Annotated[int, typer.Option("--prompt-len", min=1, help="Tokens per random prompt.")] = 16,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="Most tokens per sequence.")] = 64,
    stops: Annotated[
        int, typer.Option("--stops", min=0, help="Stop tokens (ids 4, 5, ...): rows end at random lengths.")
    ] = 0,
    stagger: Annotated[
        float, typer.Option("--stagger", min=0.0, help="Seconds between the callers' first groups.")
    ] = 0.0,
    decode_loop: Annotated[
        str, typer.Option("--loop", help="The engine's decode loop: sync | overlap.")
    ] = "sync",
    device: Annotated[str, typer.Option("--device", help="auto | cpu | cuda.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16.")] = "float32",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed rounds per rule (median).")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts and the sampling.")] = 0,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads.")] = 1,
) -> None:
    """Stream GRPO groups through the engine as a RaaS does, under several admission rules side by side."""
    from astraflow import log
    from astraflow.bench.rollout_stream import format_stream_table, parse_rules, run_stream_bench
    from astraflow.errors import AstraflowError

    log.setup("bench")
    if decode_loop not in ("sync", "overlap"):
        raise AstraflowError(f"unknown --loop {decode_loop!r}", hint="choose sync or overlap")
    res = run_stream_bench(
        model,
        parse_rules(rules),
        max_batch=max_batch,
        group=group,
        in_flight=in_flight,
        groups=groups,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        stops=stops,
        stagger_s=stagger,
        decode_loop=decode_loop,
        device=device,
        dtype=dtype,
        repeats=repeats,
        seed=seed,
        threads=threads,
    )
    typer.echo(format_stream_table(res))


@app.command("trainer")
def trainer(
    model: Annotated[
        Path,
        typer.Option("--model", help="Model directory (e.g. `astraflow model init --preset 0.6b-shape`)."),
    ],
    batch: Annotated[
        int, typer.Option("--batch", min=1, help="Sequences per step (per rank under torchrun).")
    ] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per sequence.")] = 2048,
    prompt_len: Annotated[
        int,
        typer.Option("--prompt-len", min=1, help="Untrained prompt tokens at the start of each sequence."),
    ] = 256,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", help="Trainer option KEY=VALUE (JSON value), e.g. pack=true (repeatable)."),
    ] = None,
    loss: Annotated[str, typer.Option("--loss", help="Objective plugin of the trainer side.")] = "grpo",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per side (median).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps first.")] = 2,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also time bare transformers + AdamW (one rank).")
    ] = True,
    device: Annotated[str, typer.Option("--device", help="auto | cpu | cuda.")] = "auto",
    peak_tflops: Annotated[
        float | None, typer.Option("--peak-tflops", help="Peak FLOP/s of one device in TFLOP/s (for MFU).")
    ] = None,
    json_: Annotated[
        bool, typer.Option("--json", help="Print the result as JSON on stdout (the table goes to stderr).")
    ] = False,
) -> None:
    """Tokens/s, MFU and peak memory of the trainer's step beside a bare transformers step."""
    import json

    from astraflow import log
    from astraflow.bench.rollout import check_model_dir
    from astraflow.bench.trainer import format_table, run_trainer_bench
    from astraflow.errors import AstraflowError

    log.setup("bench")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if device not in ("auto", "cpu", "cuda"):
        raise AstraflowError(f"unknown --device {device!r}", hint="choose auto, cpu or cuda")
    options: dict[str, object] = {}
    for item in option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise AstraflowError(f"--option {item!r} is not KEY=VALUE", hint='e.g. --option dtype="bfloat16"')
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    check_model_dir(model)
    from astraflow.trainers.torch_trainer import TorchTrainerConfig

    try:
        TorchTrainerConfig.model_validate(options)
    except ValueError as exc:
        raise AstraflowError(
            f"bad trainer option: {exc}", hint="see docs/recipes.md (trainer_options)"
        ) from exc
    res = run_trainer_bench(
        model,
        batch=batch,
        seq_len=seq_len,
        prompt_len=prompt_len,
        options=options,
        loss=loss,
        steps=steps,
        warmup=warmup,
        baseline=baseline,
        device=device,
        peak_tflops=peak_tflops,
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return
    typer.echo(format_table(res), err=json_)
    if json_:
        typer.echo(json.dumps(res.to_dict(), indent=2))


@app.command("wire")
def wire(
    frames: Annotated[
        int, typer.Option("--frames", min=1, help="Malformed frames sent to each service.")
    ] = 100_000,
    seconds: Annotated[
        float, typer.Option("--seconds", help="Seconds of each round-trip measurement.")
    ] = 3.0,
    json_: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Fuzz a live controller and weight server on loopback; dispatch round trips/s vs plain ZeroMQ."""
    import json
    import tempfile

    from astraflow.bench.wire import run

    with tempfile.TemporaryDirectory(prefix="astraflow-bench-wire-") as tmp:
        res = run(frames, seconds, Path(tmp))
    if json_:
        typer.echo(json.dumps(res, indent=2))
        return
    for name in ("controller", "weight_server"):
        r = res[name]
        typer.echo(
            f"{name}: frames sent {r['frames_sent']}  errors answered {r['errors_answered']}  "
            f"crashes {int(r['crashed'])}  answers afterwards {'yes' if r['answers_after'] else 'NO'}  "
            f"RSS {r['rss_mb_before']} -> {r['rss_mb_after']} MiB  ({r['seconds']}s)"
        )
    h = res["hoard_1000_chunks"]
    typer.echo(
        f"weight server, 1000 chunk requests never read: RSS {h['rss_mb_before']} -> {h['rss_mb_while_held']} "
        f"MiB while held -> {h['rss_mb_after_disconnect']} MiB after disconnect"
    )
    tp, ratio = res["roundtrips_per_s"], res["ratio_to_plain_zmq"]
    for k in tp:
        typer.echo(f"dispatch {k:16} {tp[k]:8d} round trips/s  ratio to plain zmq {ratio[k]:.3f}")

"""`astraflow bench ...`: benchmarks that print ratios against a baseline measured in the same run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from astraflow.bench.trl import TRL_VERSION

app = typer.Typer(
    help="Benchmarks with ratios against a baseline measured in the same run.", no_args_is_help=True
)


def _interrupt(_signum: int, _frame: Any) -> None:
    """SIGTERM stops the bench like Ctrl-C: the running recipe's `astraflow up` is stopped first."""
    raise KeyboardInterrupt


@app.command("data")
def data(
    recipes: Annotated[list[Path], typer.Argument(help="Recipes to compare; the first is the baseline.")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field of every recipe: a.b=value (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory for the run directories (default runs/bench-data-<time>/)."),
    ] = None,
    json_: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the comparison as JSON on stdout (progress and table go to stderr)."
        ),
    ] = False,
    target: Annotated[
        float | None, typer.Option("--target", help="Reward target (default: see --target-frac).")
    ] = None,
    target_frac: Annotated[
        float,
        typer.Option(
            "--target-frac",
            help="Without --target: this fraction of the way from the baseline's start to the best final reward.",
        ),
    ] = 0.5,
    window: Annotated[
        int, typer.Option("--window", min=1, help="Versions in the rolling mean compared with the target.")
    ] = 10,
    timeout_s: Annotated[
        float,
        typer.Option("--timeout-s", help="Stop a run that takes longer than this and record it as failed."),
    ] = 3600.0,
    seeds: Annotated[
        str | None,
        typer.Option(
            "--seeds",
            help="Run every recipe once per seed (run.seed), e.g. 0,1,2; the table shows means and ranges.",
        ),
    ] = None,
) -> None:
    """Run each recipe through `astraflow up` in turn and compare rollouts, reward and wall time."""
    import json
    import signal

    from astraflow import log
    from astraflow.bench.data import (
        format_seed_table,
        format_table,
        parse_seeds,
        run_names,
        run_recipe,
        summarize,
    )
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.errors import AstraflowError

    log.setup("bench")
    signal.signal(signal.SIGTERM, _interrupt)
    if not recipes:
        raise AstraflowError(
            "no recipes given", hint="e.g. astraflow bench data recipes/math-efficient-data/a-none.toml ..."
        )
    overrides = set_ or []
    seed_list: list[int | None] = list(parse_seeds(seeds)) if seeds is not None else [None]
    for path in recipes:
        # Every recipe is checked before the first run starts, so a typo does not cost a finished run.
        for seed in seed_list:
            validate_plugins(load_recipe(path, overrides + ([] if seed is None else [f"run.seed={seed}"])))
    base = out or Path("runs") / f"bench-data-{time.strftime('%Y%m%d-%H%M%S')}"
    base.mkdir(parents=True, exist_ok=True)
    results = []
    names = run_names(recipes)
    # Recipe-major order: one variant's seeds run back to back, so a partial bench still compares seeds.
    jobs = [(path, name, seed) for path, name in zip(recipes, names, strict=True) for seed in seed_list]
    for i, (path, name, seed) in enumerate(jobs, 1):
        run_dir = base / name if seed is None else base / name / f"seed-{seed}"
        res = run_recipe(path, name, run_dir, overrides, timeout_s, seed=seed)
        results.append(res)
        label = name if seed is None else f"{name} seed {seed}"
        if res.ok:
            reward = "-" if res.reward_final is None else f"{res.reward_final:.3f}"
            line = (
                f"[{i}/{len(jobs)}] {label}: ok, {res.steps} steps, reward {reward}, "
                f"{res.generated} rollouts, {res.wall_s:.0f}s -> {res.run_dir}"
            )
        else:
            line = f"[{i}/{len(jobs)}] {label}: FAILED after {res.wall_s:.0f}s: {res.error}"
        typer.echo(line, err=json_)
    summary = summarize(results, target=target, target_frac=target_frac, window=window)
    summary["out"] = str(base)
    (base / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    # With --json, stdout is only the JSON (for jq and scripts); the people watching read stderr.
    typer.echo("", err=json_)
    typer.echo(format_table(summary) if seeds is None else format_seed_table(summary), err=json_)
    typer.echo(f"\nfull results: {base / 'bench.json'}", err=json_)
    if json_:
        typer.echo(json.dumps(summary, indent=2))


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
    )
    typer.echo(format_table(res), err=json_)
    if json_:
        typer.echo(json.dumps(res.to_dict(), indent=2))


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
    import os

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


@app.command("weights")
def weights(
    model: Annotated[
        Path,
        typer.Option("--model", help="Model directory (e.g. `astraflow model init --preset 0.6b-shape`)."),
    ],
    device: Annotated[
        str, typer.Option("--device", help="cpu, cuda or cuda:N: where the trainer's weights live.")
    ] = "cpu",
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, help="Versions sent on each path (the median counts).")
    ] = 5,
    connections: Annotated[
        int,
        typer.Option(
            "--connections",
            min=0,
            max=8,
            help="ZeroMQ pull connections (and link streams) measured beside one; 0: min(4, cores).",
        ),
    ] = 0,
    json_: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Seconds per version and GB/s on each weight path, beside the copy limit measured in the same run."""
    import json

    from astraflow.bench.weights import format_lines, run

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            from astraflow.errors import AstraflowError

            raise AstraflowError("--device cuda but no CUDA device is visible", hint="use --device cpu")
    res = run(model, device, repeats, connections)
    if json_:
        typer.echo(json.dumps(res, indent=2))
        return
    for line in format_lines(res):
        typer.echo(line)


@app.command("broadcast")
def broadcast(
    preset: Annotated[
        str, typer.Option("--preset", help="Comma-separated qwen3 presets whose shapes are sent.")
    ] = "0.6b-shape",
    engines: Annotated[int, typer.Option("--engines", min=1, help="Engine processes receiving.")] = 2,
    device: Annotated[
        str, typer.Option("--device", help="cpu (gloo) or cuda (NCCL, one GPU a rank).")
    ] = "cpu",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Versions sent (the median counts).")] = 3,
    churn: Annotated[
        bool, typer.Option("--churn/--no-churn", help="Kill an engine mid-broadcast and add one.")
    ] = False,
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", min=1.0, help="Collective timeout (a dead engine costs this).")
    ] = 15.0,
    json_: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """The trainer's weight broadcast to many engines, beside an all-reduce's bus bandwidth."""
    import json

    from astraflow.bench.broadcast import format_lines, run
    from astraflow.errors import AstraflowError

    if device not in ("cpu", "cuda"):
        raise AstraflowError(f"unknown --device {device!r}", hint="choose cpu or cuda")
    presets = [p.strip() for p in preset.split(",") if p.strip()]
    res = run(presets, engines, device, repeats, churn, timeout_s)
    if json_:
        typer.echo(json.dumps(res, indent=2))
    else:
        for line in format_lines(res):
            typer.echo(line)
    bad = [m for r in res["rows"] for m in r["digest_mismatches"]]
    if bad:
        raise AstraflowError(f"digest mismatch on {bad}", hint="a broadcast delivered wrong bytes")


@app.command("pipeline")
def pipeline(
    recipe: Annotated[Path, typer.Argument(help="Recipe to run in sync mode, then in async mode.")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a recipe field in both runs: a.b=value (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Directory for the two run directories (default runs/bench-pipeline-<time>/)."
        ),
    ] = None,
    json_: Annotated[
        bool,
        typer.Option("--json", help="Print the comparison as JSON on stdout (the table goes to stderr)."),
    ] = False,
    timeout_s: Annotated[
        float,
        typer.Option("--timeout-s", help="Stop a run that takes longer than this and record it as failed."),
    ] = 3600.0,
) -> None:
    """Run one recipe lock-step (run.mode=sync) and asynchronously; compare pace, idle time and staleness."""
    import json
    import signal
    import sqlite3

    from astraflow import log
    from astraflow.bench.e2e import GpuSampler, format_report, read_e2e
    from astraflow.bench.pipeline import MODES, compare, format_table, run_mode
    from astraflow.config.load import load_recipe, validate_plugins

    log.setup("bench")
    signal.signal(signal.SIGTERM, _interrupt)
    overrides = set_ or []
    r = load_recipe(recipe, overrides)
    validate_plugins(r)
    base = out or Path("runs") / f"bench-pipeline-{time.strftime('%Y%m%d-%H%M%S')}"
    base.mkdir(parents=True, exist_ok=True)
    results = []
    reports: dict[str, str] = {}
    gpus = GpuSampler().start()
    try:
        for mode in MODES:
            res = run_mode(
                recipe, mode, base / mode, overrides, timeout_s, r.rollout.local_workers, r.rollout.slots
            )
            results.append(res)
            status = "ok" if res.ok else f"FAILED: {res.error}"
            typer.echo(f"{mode}: {status} ({res.wall_s:.0f}s) -> {res.run_dir}", err=json_)
    finally:
        gpus.stop()
    summary = compare(results)
    summary["out"] = str(base)
    # the end-to-end view of each run: samples/s, busy fractions, weight sync (bench/e2e.py)
    summary["e2e"] = {}
    for res in results:
        # a failed (e.g. timed-out) run still has the steps it completed: reported, marked partial
        label = res.mode if res.ok else f"{res.mode} (partial: the run failed; the steps it completed)"
        try:
            rep = read_e2e(Path(res.run_dir), gpus)
        except (OSError, ValueError, KeyError, sqlite3.Error) as exc:
            reports[label] = f"(no end-to-end report: {exc})"
            continue
        rep["partial"] = not res.ok
        summary["e2e"][res.mode] = rep
        reports[label] = format_report(rep)
    (base / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    for mode, text in reports.items():
        typer.echo(f"\n{mode}:\n{text}", err=json_)
    typer.echo("", err=json_)
    typer.echo(format_table(summary), err=json_)
    if json_:
        typer.echo(json.dumps(summary, indent=2))


@app.command("e2e")
def e2e(
    recipe: Annotated[Path, typer.Argument(help="Recipe to run through `astraflow up`.")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a recipe field: a.b=value (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Run directory (default runs/bench-e2e-<time>/)."),
    ] = None,
    json_: Annotated[
        bool,
        typer.Option("--json", help="Print the report as JSON on stdout (the table goes to stderr)."),
    ] = False,
    timeout_s: Annotated[
        float,
        typer.Option("--timeout-s", help="Stop a run that takes longer than this and report it failed."),
    ] = 3600.0,
) -> None:
    """Run a recipe end to end; report samples/s, each role's busy fraction and weight-sync time per step."""
    import json
    import signal
    import sqlite3

    from astraflow import log
    from astraflow.bench.data import run_recipe
    from astraflow.bench.e2e import GpuSampler, format_report, read_e2e
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.errors import AstraflowError

    log.setup("bench")
    signal.signal(signal.SIGTERM, _interrupt)
    overrides = set_ or []
    validate_plugins(load_recipe(recipe, overrides))
    run_dir = out or Path("runs") / f"bench-e2e-{time.strftime('%Y%m%d-%H%M%S')}"
    gpus = GpuSampler().start()
    try:
        res = run_recipe(recipe, "e2e", run_dir, overrides, timeout_s)
    finally:
        gpus.stop()
    typer.echo(
        f"run: {'ok' if res.ok else 'FAILED: ' + res.error} ({res.wall_s:.0f}s) -> {run_dir}", err=json_
    )
    try:
        rep = read_e2e(run_dir, gpus)
    except (OSError, ValueError, KeyError, sqlite3.Error) as exc:
        if res.ok:
            raise AstraflowError(f"cannot read the run back: {exc}", hint=f"see {run_dir}") from exc
        rep = None
    if not res.ok:
        if rep is not None:  # the steps a failed run completed, for what they are worth
            typer.echo("partial report (the run failed):\n" + format_report(rep), err=True)
        raise AstraflowError(f"the run failed: {res.error}", hint=f"see {run_dir}/up.log and {run_dir}/logs/")
    assert rep is not None
    rep["wall_s"] = res.wall_s
    (run_dir / "e2e.json").write_text(json.dumps(rep, indent=2) + "\n")
    typer.echo(format_report(rep), err=json_)
    if json_:
        typer.echo(json.dumps(rep, indent=2))


@app.command("delta")
def delta(
    recipe: Annotated[
        Path | None, typer.Argument(help="Recipe to train through `astraflow up` with weights.mode=delta.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a recipe field: a.b=value (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Run directory (default runs/bench-delta-<time>/)."),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Stop a run that takes longer.")] = 3600.0,
    speed_gb: Annotated[
        float,
        typer.Option(
            "--speed-gb",
            help="Instead of a run: time encode/apply/sha256 of a delta of a synthetic bf16 version of this many GB (1% changed) beside a plain copy.",
        ),
    ] = 0.0,
) -> None:
    """Train a recipe with weight deltas on; report each version's delta size as a share of the full version."""
    import json
    import signal

    if speed_gb > 0:
        import torch

        from astraflow.bench.delta import delta_speed

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
        sp = delta_speed(speed_gb)
        typer.echo(json.dumps(sp, indent=2) if json_ else "  ".join(f"{k} {v:.3g}" for k, v in sp.items()))
        return

    from astraflow import log
    from astraflow.bench.data import run_recipe
    from astraflow.bench.delta import DELTA_SETS, delta_report, format_delta_report
    from astraflow.errors import AstraflowError

    if recipe is None:
        raise AstraflowError(
            "bench delta needs a recipe (or --speed-gb)", hint="astraflow bench delta RECIPE.toml"
        )
    log.setup("bench")
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir = out or Path("runs") / f"bench-delta-{time.strftime('%Y%m%d-%H%M%S')}"
    res = run_recipe(recipe, "delta", run_dir, [*(set_ or []), *DELTA_SETS], timeout_s)
    if not res.ok:
        raise AstraflowError(f"the run failed: {res.error}", hint=f"see {run_dir}/up.log and {run_dir}/logs/")
    rep = delta_report(run_dir)
    typer.echo(format_delta_report(rep), err=json_)
    if json_:
        typer.echo(json.dumps(rep, indent=2))


def _seed_list(text: str | None) -> list[int] | None:
    """--seeds "0,1,2" as [0, 1, 2]; None when not given; a clear error on anything else."""
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise typer.BadParameter(f"--seeds takes distinct comma-separated integers, got {text!r}")
    return seeds


@app.command("trl")
def trl(
    recipe: Annotated[
        Path, typer.Argument(help="A quickstart recipe (one grpo policy, the quickstart workflow).")
    ] = Path("recipes/quickstart/recipe.toml"),
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a recipe field (both sides see it): a.b=value (repeatable)."),
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Optimizer steps of each side (default: run.steps).")
    ] = None,
    trl_version: Annotated[
        str, typer.Option("--trl-version", help="TRL release installed on first use into ~/.cache/astraflow.")
    ] = TRL_VERSION,
    trl_path: Annotated[
        Path | None,
        typer.Option(
            "--trl-path", help="A directory TRL is already installed in (pip --target); no install."
        ),
    ] = None,
    trl_threads: Annotated[
        int,
        typer.Option("--trl-threads", min=1, help="torch threads of the TRL process (astraflow's roles: 1)."),
    ] = 1,
    out: Annotated[
        Path | None, typer.Option("--out", help="Directory for both runs (default runs/bench-trl-<time>/).")
    ] = None,
    json_: Annotated[
        bool, typer.Option("--json", help="Print the summary as JSON on stdout (the table goes to stderr).")
    ] = False,
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", help="Give up on a side that takes longer than this.")
    ] = 3600.0,
    seeds: Annotated[
        str | None,
        typer.Option(
            "--seeds",
            help="Comma-separated run seeds (e.g. 0,1,2): one pair of runs per seed, then each side's mean "
            "and spread of the steps to the reward target and of the reward over the last tenth.",
        ),
    ] = None,
    target: Annotated[
        float,
        typer.Option("--target", help="Reward target: the first step whose 5-step mean reward reaches it."),
    ] = 0.8,
    device: Annotated[
        str, typer.Option("--device", help="Where TRL and the held-out evaluator run: cpu or cuda.")
    ] = "cpu",
    heldout: Annotated[
        int,
        typer.Option(
            "--heldout",
            min=0,
            help="Score every checkpoint of both sides on this many held-out prompts (greedy, exact "
            "answer) against wall-clock time; 0: off.",
        ),
    ] = 0,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", min=1, help="Steps between the checkpoints --heldout scores.")
    ] = 10,
) -> None:
    """The quickstart through `astraflow up` and through TRL's GRPOTrainer (same model, task, seed and
    settings), one after the other; prints wall and step times, reward curves and astraflow/TRL."""
    import json
    import signal

    from astraflow import log
    from astraflow.bench.trl import run_bench

    log.setup("bench")
    signal.signal(signal.SIGTERM, _interrupt)
    base = out or Path("runs") / f"bench-trl-{time.strftime('%Y%m%d-%H%M%S')}"
    seed_list = _seed_list(seeds)
    summary = run_bench(
        recipe,
        set_ or [],
        base,
        steps=steps,
        trl_version=trl_version,
        trl_path=trl_path,
        trl_threads=trl_threads,
        timeout_s=timeout_s,
        seeds=seed_list,
        target=target,
        say=lambda line: typer.echo(line, err=True),
        device=device,
        heldout=heldout,
        checkpoint_every=checkpoint_every,
    )
    typer.echo("", err=json_)
    typer.echo(summary["table"], err=json_)
    typer.echo(f"\nfull results: {base / 'bench.json'}", err=json_)
    if json_:
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=2))


@app.command("dash")
def dash(
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Recorded steps of the synthetic run.")
    ] = 10_000,
    seconds: Annotated[float, typer.Option("--seconds", help="Duration of each writer measurement.")] = 3.0,
    interval: Annotated[float, typer.Option("--interval", help="The dashboard's poll interval.")] = 1.0,
) -> None:
    """The dashboard's start-up on a long run, one poll's cost, and state.db writes with it attached."""
    from astraflow.cli.dash import run_dash_bench as run_bench

    r = run_bench(steps, seconds, interval)
    typer.echo(
        f"synthetic run: {steps} steps (state.db via the real Store, metrics.jsonl rows of 36 metrics)"
    )
    typer.echo(
        f"start-up: first paint {r['first_paint_s'] * 1000:.0f} ms; baseline (parse all of metrics.jsonl) "
        f"{r['full_parse_s'] * 1000:.0f} ms; ratio {r['first_paint_s'] / r['full_parse_s']:.2f}; "
        f"history in after {r['history_loaded_s'] * 1000:.0f} ms"
    )
    typer.echo(
        f"cold start (a fresh interpreter to the first frame drawn with data; best of 3): "
        f"{r['cold_start_s'] * 1000:.0f} ms wall, {r['cold_start_cpu_s'] * 1000:.0f} ms CPU "
        f"(of which interpreter and imports {r['import_s'] * 1000:.0f} ms wall, "
        f"{r['import_cpu_s'] * 1000:.0f} ms CPU); target < 1000 ms; "
        f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    typer.echo(
        f"one poll (run-dir source): {r['poll_s'] * 1000:.1f} ms; one StatusReply built by the controller "
        f"(--controller source): {r['status_reply_s'] * 1000:.1f} ms = {r['status_reply_s'] / interval * 100:.2f}% "
        f"of the controller's time at one poll per {interval:g}s"
    )
    typer.echo(
        f"controller-shaped writes/s: alone {r['writes_per_s_alone']:.0f}; with a dashboard polling every "
        f"{interval:g}s {r['writes_per_s_dashboard']:.0f} (ratio {r['writes_per_s_dashboard'] / r['writes_per_s_alone']:.3f}); "
        f"with a reader polling at 20 Hz {r['writes_per_s_20hz_reader']:.0f} "
        f"(ratio {r['writes_per_s_20hz_reader'] / r['writes_per_s_alone']:.3f})"
    )


@app.command("control")
def control(
    members: str = typer.Option("2,100,1000", help="Comma-separated simulated worker counts, one run each."),
    curve: str = typer.Option("off,on", help="CURVE off, on, or both (off,on): every member its own key."),
    seconds: float = typer.Option(10.0, help="Measured window per run, after the warm-up steps."),
    warmup_steps: int = typer.Option(3, help="Steps the controller records before the window opens."),
    heartbeat_s: float = typer.Option(
        0.5, help="The recipe's heartbeat interval (every member beats this often)."
    ),
    procs: int = typer.Option(
        4, help="Simulator processes: one for the trainer and active workers, the rest share idle members."
    ),
    out: Path = typer.Option(None, help="Keep the runs' directories here (default: a temporary directory)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    keep_steps: int = typer.Option(
        0, help="Retention: trajectories consumed this many steps ago leave state.db for Parquet (0: off)."
    ),
    results: str = typer.Option(
        "grouped",
        help="How workers send results: grouped (a grant's in one TaskResults), single (a TaskResult each), or both.",
    ),
    tokens: int = typer.Option(
        3, help="Generated tokens of each simulated sequence (after 3 prompt tokens)."
    ),
    in_process: bool = typer.Option(
        False,
        "--in-process",
        help="No sockets: drive Controller.dispatch with the 2 workers' and the trainer's messages and "
        "report its CPU per sequence (only --tokens, --warmup-steps, --steps, --profile, --json apply).",
    ),
    steps: int = typer.Option(20, help="--in-process: measured steps (after the warm-up steps)."),
    profile: bool = typer.Option(
        False, help="--in-process: also print the top functions by own time (cProfile)."
    ),
) -> None:
    """One live controller fed by simulated members: sequences/s, steps/s, CPU per step, request
    latency and RSS per member, for each member count; raw ZeroMQ and SQLite rates as the limits."""
    import json as _json
    import tempfile

    if in_process:
        from astraflow.bench import control_inproc

        if tokens < 1 or steps < 1 or warmup_steps < 0:
            raise typer.BadParameter("--tokens and --steps take numbers >= 1, --warmup-steps >= 0")
        r = control_inproc.run(steps=steps, warmup_steps=warmup_steps, tokens=tokens, profile=profile)
        typer.echo(_json.dumps(r, indent=2) if as_json else control_inproc.render(r))
        return

    from astraflow.bench.control import render, run

    counts = [int(x) for x in members.split(",") if x.strip()]
    modes = {"off": [False], "on": [True], "off,on": [False, True], "on,off": [True, False]}.get(
        curve.replace(" ", "")
    )
    grouping = {"grouped": (True,), "single": (False,), "both": (True, False)}.get(results.strip())
    if not counts or min(counts) < 1 or modes is None or grouping is None or tokens < 1:
        raise typer.BadParameter(
            "--members takes counts >= 1 (e.g. 2,100,1000); --curve off, on or off,on; --results grouped, single or both; "
            "--tokens >= 1"
        )
    with tempfile.TemporaryDirectory() as tmp:
        res = run(
            counts,
            curve=modes,
            seconds=seconds,
            warmup_steps=warmup_steps,
            heartbeat_s=heartbeat_s,
            procs=procs,
            work=out or Path(tmp),
            progress=lambda line: typer.echo(line, err=True),
            results=grouping,
            keep_steps=keep_steps,
            tokens=tokens,
        )
    typer.echo(_json.dumps(res, indent=2) if as_json else render(res))

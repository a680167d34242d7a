"""`astraflow bench` commands. Benchmarks of the weight paths: every transport, the cross-host broadcast, deltas."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from astraflow.cli.bench.common import app, sigterm_as_interrupt


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
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    run_dir = out or Path("runs") / f"bench-delta-{time.strftime('%Y%m%d-%H%M%S')}"
    res = run_recipe(recipe, "delta", run_dir, [*(set_ or []), *DELTA_SETS], timeout_s)
    if not res.ok:
        raise AstraflowError(f"the run failed: {res.error}", hint=f"see {run_dir}/up.log and {run_dir}/logs/")
    rep = delta_report(run_dir)
    typer.echo(format_delta_report(rep), err=json_)
    if json_:
        typer.echo(json.dumps(rep, indent=2))

"""`astraflow bench` commands. Benchmarks of the control plane: the dashboard's reads and one controller's throughput."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from astraflow.bench.control_recipe import Shape

from astraflow.cli.bench.common import app


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


def _control_in_process(
    beats: int,
    heartbeat_s: float,
    tokens: int,
    steps: int,
    warmup_steps: int,
    *,
    keep_steps: int,
    profile: bool,
    as_json: bool,
    shape: Shape,
    archiver: str,
) -> None:
    """`bench control --in-process`: the controller's CPU per sequence, or with `--beats N` per idle
    heartbeat of N members."""
    import json as _json

    if beats:
        from astraflow.bench import control_beats

        if beats < 1 or heartbeat_s <= 0:
            raise typer.BadParameter("--beats takes a member count >= 1, --heartbeat-s a time > 0")
        rb = control_beats.run(beats, heartbeat_s=heartbeat_s, profile=profile)
        typer.echo(_json.dumps(rb, indent=2) if as_json else control_beats.render(rb))
        return
    from astraflow.bench import control_inproc

    if tokens < 1 or steps < 1 or warmup_steps < 0 or keep_steps < 0:
        raise typer.BadParameter(
            "--tokens and --steps take numbers >= 1, --warmup-steps and --keep-steps >= 0"
        )
    r = control_inproc.run(
        steps=steps,
        warmup_steps=warmup_steps,
        tokens=tokens,
        keep_steps=keep_steps,
        profile=profile,
        shape=shape,
        archiver=archiver,
    )
    typer.echo(_json.dumps(r, indent=2) if as_json else control_inproc.render(r))


def _archiver(value: str) -> None:
    """A usage error unless --archiver is inline or process."""
    if value not in ("inline", "process"):
        raise typer.BadParameter(f"--archiver takes inline or process, not {value!r}")


def _shape(group_size: int, batch_prompts: int, slots: int) -> Shape:
    """The step shape of --group-size, --batch-prompts and --slots, or a usage error."""
    from astraflow.bench.control_recipe import Shape

    shape = Shape(group_size, batch_prompts, slots)
    try:
        shape.check()
    except ValueError as exc:
        raise typer.BadParameter(f"--group-size, --batch-prompts and --slots: {exc}") from None
    return shape


@app.command("control")
def control(
    members: str = typer.Option("2,100,1000", help="Comma-separated simulated worker counts, one run each."),
    curve: str = typer.Option("off,on", help="CURVE off, on, or both (off,on): every member its own key."),
    seconds: float = typer.Option(10.0, help="Measured window per run, after the warm-up steps."),
    warmup_steps: int = typer.Option(3, help="Steps the controller records before the window opens."),
    settle_s: float = typer.Option(
        0.0,
        help="Seconds waited after the warm-up steps before the window opens (every row): the aftermath "
        "of thousands of joins (their handshakes, their first beats) left out of a steady-state window.",
    ),
    heartbeat_s: float = typer.Option(
        0.5, help="The recipe's heartbeat interval (every member beats this often)."
    ),
    procs: int = typer.Option(
        4,
        help="Simulator processes: the trainer and each active worker get one of their own; the idle "
        "members share procs - 1 more (at least one).",
    ),
    idle_beats_per_s: float = typer.Option(
        None, help="controller.idle_beats_per_s of the bench's recipe (default: the recipe's default)."
    ),
    out: Path = typer.Option(None, help="Keep the runs' directories here (default: a temporary directory)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    keep_steps: int = typer.Option(
        0, help="Retention: trajectories consumed this many steps ago leave state.db for Parquet (0: off)."
    ),
    archiver: str = typer.Option(
        "inline",
        help="With --keep-steps: controller.retention.archiver, inline or process (the passes' reads and "
        "Parquet files in an archiver process; live, on the simulators' CPUs when --controller-cpu is set).",
    ),
    results: str = typer.Option(
        "grouped",
        help="How workers send results: grouped (a grant's in one TaskResults), single (a TaskResult each), "
        "tasks (a TaskResults each), both (grouped, single) or all three.",
    ),
    tokens: int = typer.Option(
        3, help="Generated tokens of each simulated sequence (after 3 prompt tokens)."
    ),
    in_process: bool = typer.Option(
        False,
        "--in-process",
        help="No sockets: drive Controller.dispatch with the 2 workers' and the trainer's messages and "
        "report its CPU per sequence (only --tokens, --warmup-steps, --steps, --keep-steps, --group-size, "
        "--batch-prompts, --slots, --profile, --json apply).",
    ),
    steps: int = typer.Option(20, help="--in-process: measured steps (after the warm-up steps)."),
    profile: bool = typer.Option(
        False, help="--in-process: also print the top functions by own time (cProfile)."
    ),
    controller_cpu: int = typer.Option(
        None,
        help="Pin the controller (every thread, libzmq's included) to this CPU and the simulators to "
        "the others, its core's SMT siblings left idle: the controller's rate on one core of its own.",
    ),
    repeat: int = typer.Option(
        1,
        help="Rounds of the member counts, run in turn (2, 10000, 2, 10000, ...); each row's ratio is "
        "against its own round's first row, and the table ends with each count's medians.",
    ),
    beats: int = typer.Option(
        0,
        help="--in-process: instead of steps, this many idle members joined and beating at "
        "--heartbeat-s: the controller's CPU per heartbeat (bench/control_beats.py).",
    ),
    group_size: int = typer.Option(16, help="Sequences a task of the bench's policy (the quickstart's 16)."),
    batch_prompts: int = typer.Option(
        32, help="Tasks a step of the bench's policy (the quickstart's 32); each worker asks for this many."
    ),
    slots: int = typer.Option(
        0,
        help="Tasks each worker asks for at a time and answers in one message, instead of --batch-prompts "
        "(0): 1 shows what a message costs the controller whatever it carries.",
    ),
) -> None:
    """One live controller fed by simulated members: sequences/s, steps/s, CPU per step, request
    latency and RSS per member, for each member count; raw ZeroMQ and SQLite rates as the limits."""
    import json as _json
    import tempfile

    shape = _shape(group_size, batch_prompts, slots)
    _archiver(archiver)
    if in_process:
        _control_in_process(
            beats,
            heartbeat_s,
            tokens,
            steps,
            warmup_steps,
            keep_steps=keep_steps,
            profile=profile,
            as_json=as_json,
            shape=shape,
            archiver=archiver,
        )
        return

    from astraflow.bench.control import run
    from astraflow.bench.control_table import render

    counts = [int(x) for x in members.split(",") if x.strip()]
    modes = {"off": [False], "on": [True], "off,on": [False, True], "on,off": [True, False]}.get(
        curve.replace(" ", "")
    )
    grouping = {
        "grouped": ("grouped",),
        "single": ("single",),
        "tasks": ("tasks",),
        "both": ("grouped", "single"),
        "all": ("grouped", "single", "tasks"),
    }.get(results.strip())
    cpus = sorted(os.sched_getaffinity(0))
    if controller_cpu is not None and (controller_cpu not in cpus or len(cpus) < 2):
        raise typer.BadParameter(
            f"--controller-cpu takes one of this process's CPUs {cpus}, and needs another for the simulators"
        )
    numbers_ok = min(counts, default=0) >= 1 and tokens >= 1 and settle_s >= 0 and repeat >= 1
    if not numbers_ok or modes is None or grouping is None:
        raise typer.BadParameter(
            "--members takes counts >= 1 (e.g. 2,100,1000); --curve off, on or off,on; --results grouped, single, tasks, both or all; "
            "--tokens >= 1; --settle-s >= 0; --repeat >= 1"
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
            idle_beats_per_s=idle_beats_per_s,
            controller_cpu=controller_cpu,
            settle_s=settle_s,
            repeat=repeat,
            shape=shape,
            archiver=archiver,
        )
    typer.echo(_json.dumps(res, indent=2) if as_json else render(res))

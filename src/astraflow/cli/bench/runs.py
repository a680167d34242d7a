"""`astraflow bench` commands. Benchmarks that run recipes through `astraflow up`: data stages, the pipeline, end to end, against TRL."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from astraflow.bench.trl_install import TRL_VERSION
from astraflow.cli.bench.common import app, parse_seed_list, sigterm_as_interrupt

if TYPE_CHECKING:
    from astraflow.bench.data import RunResult


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
    from astraflow.bench.data import parse_seeds, run_names, run_recipe
    from astraflow.bench.data_compare import format_seed_table, format_table, summarize
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.errors import AstraflowError

    log.setup("bench")
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    if not recipes:
        raise AstraflowError(
            "no recipes given", hint="e.g. astraflow bench data recipes/math-efficient-data/a-none.toml ..."
        )
    overrides = set_ or []
    seeds_to_run: list[int | None] = list(parse_seeds(seeds)) if seeds is not None else [None]
    for path in recipes:
        # Every recipe is checked before the first run starts, so a typo does not cost a finished run.
        for seed in seeds_to_run:
            validate_plugins(load_recipe(path, overrides + ([] if seed is None else [f"run.seed={seed}"])))
    base = out or Path("runs") / f"bench-data-{time.strftime('%Y%m%d-%H%M%S')}"
    base.mkdir(parents=True, exist_ok=True)
    results = []
    names = run_names(recipes)
    # Recipe-major order: one variant's seeds run back to back, so a partial bench still compares seeds.
    jobs = [(path, name, seed) for path, name in zip(recipes, names, strict=True) for seed in seeds_to_run]
    for i, (path, name, seed) in enumerate(jobs, 1):
        run_dir = base / name if seed is None else base / name / f"seed-{seed}"
        res = run_recipe(path, name, run_dir, overrides, timeout_s, seed=seed)
        results.append(res)
        label = name if seed is None else f"{name} seed {seed}"
        typer.echo(f"[{i}/{len(jobs)}] {label}: {_outcome(res)}", err=json_)
    summary = summarize(results, target=target, target_frac=target_frac, window=window)
    summary["out"] = str(base)
    (base / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    # With --json, stdout is only the JSON (for jq and scripts); the people watching read stderr.
    typer.echo("", err=json_)
    typer.echo(format_table(summary) if seeds is None else format_seed_table(summary), err=json_)
    typer.echo(f"\nfull results: {base / 'bench.json'}", err=json_)
    if json_:
        typer.echo(json.dumps(summary, indent=2))


def _outcome(res: RunResult) -> str:
    """One finished run of `bench data`, in words."""
    if not res.ok:
        return f"FAILED after {res.wall_s:.0f}s: {res.error}"
    reward = "-" if res.reward_final is None else f"{res.reward_final:.3f}"
    return f"ok, {res.steps} steps, reward {reward}, {res.generated} rollouts, {res.wall_s:.0f}s -> {res.run_dir}"


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
    from astraflow.bench.pipeline import MODES, add_steady, compare, format_table, run_mode
    from astraflow.config.load import load_recipe, validate_plugins

    log.setup("bench")
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
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
    add_steady(summary)
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
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
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
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    base = out or Path("runs") / f"bench-trl-{time.strftime('%Y%m%d-%H%M%S')}"
    seed_values = parse_seed_list(seeds)
    summary = run_bench(
        recipe,
        set_ or [],
        base,
        steps=steps,
        trl_version=trl_version,
        trl_path=trl_path,
        trl_threads=trl_threads,
        timeout_s=timeout_s,
        seeds=seed_values,
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

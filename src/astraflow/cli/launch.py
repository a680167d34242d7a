"""`astraflow launch slurm`: start a recipe's roles on a cluster engine with the keys made here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Start a run on a cluster engine (Slurm today; Kubernetes manifests: `launch k8s`).",
    no_args_is_help=True,
)

SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")
]
RunDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--run-dir", help="Run directory, on a filesystem every node sees (default runs/<name>-<time>/)."
    ),
]


@app.command("slurm")
def slurm(
    recipe: Annotated[str, typer.Argument(help="Recipe TOML file.")],
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes", min=1, help="Nodes of the job (default: one per trainer and per RaaS worker)."
        ),
    ] = None,
    raas: Annotated[
        int | None, typer.Option("--raas", min=1, help="RaaS workers (default rollout.local_workers).")
    ] = None,
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", min=0, help="GPUs per node; 0 for a CPU job.")
    ] = 0,
    port: Annotated[int, typer.Option("--port", help="The controller's TCP port on the first node.")] = 7600,
    time_limit: Annotated[str, typer.Option("--time", help="sbatch --time (e.g. 04:00:00).")] = "",
    partition: Annotated[str, typer.Option("--partition", help="sbatch --partition.")] = "",
    python: Annotated[
        str | None,
        typer.Option("--python", help="Python with astraflow installed on every node (default: this one)."),
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Set every library's offline switch in every role.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the sbatch script; write and submit nothing.")
    ] = False,
) -> None:
    """Write the run directory, its keys and RUN/launch/slurm.sbatch, then submit it with sbatch.
    Submitting the same script again (or this command with the same --run-dir) resumes the run."""
    import shutil
    import subprocess

    from astraflow.cluster.plan import absolute_models, make_plan, prepare_run
    from astraflow.cluster.slurm import SlurmOptions, render
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.errors import AstraflowError
    from astraflow.rundir import default_run_dir

    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    absolute_models(r, Path.cwd())
    plan = make_plan(r, run_dir or default_run_dir(r), raas)
    opts = SlurmOptions(
        nodes=nodes or len(plan.trainers) + len(plan.raas),
        python=python or sys.executable,
        port=port,
        gpus_per_node=gpus_per_node,
        time=time_limit,
        partition=partition,
        offline=offline,
    )
    script = render(plan, opts)
    if dry_run:
        typer.echo(script, nl=False)
        return
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise AstraflowError(
            "sbatch is not on PATH: this is not a Slurm login node",
            hint="run this on a node that submits jobs, or --dry-run to see the script",
        )
    prepare_run(r, plan)
    path = plan.run_dir / "launch" / "slurm.sbatch"
    path.parent.mkdir(exist_ok=True)
    path.write_text(script)
    out = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise AstraflowError(f"sbatch refused {path}: {out.stderr.strip()}", hint="see the script above it")
    job = out.stdout.strip().split(";")[0]
    typer.echo(f"submitted job {job}: {path}")
    typer.echo(f"run directory {plan.run_dir}; follow it with: astraflow status --run-dir {plan.run_dir}")

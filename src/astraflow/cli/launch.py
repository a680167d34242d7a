"""`astraflow launch ray|slurm|k8s`: start a recipe's roles on a cluster engine with the keys made here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Start a run on a cluster engine: Ray (actors), Slurm (a batch job) or Kubernetes (manifests).",
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


@app.command("ray")
def ray_(
    recipe: Annotated[str, typer.Argument(help="Recipe TOML file.")],
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    address: Annotated[
        str,
        typer.Option(
            "--address",
            help="Ray cluster to attach to (default RAY_ADDRESS, else the one `ray start` started on this "
            "machine, else a new local cluster that ends with the run).",
        ),
    ] = "",
    raas: Annotated[
        int | None,
        typer.Option("--raas", min=1, help="RaaS workers to start with (default rollout.local_workers)."),
    ] = None,
    port: Annotated[
        int, typer.Option("--port", min=0, help="The controller's TCP port on its node (0: a free one).")
    ] = 0,
    trainer_gpus: Annotated[
        bool, typer.Option("--trainer-gpus", help="One GPU per trainer rank (policy.trainer_nproc).")
    ] = False,
    gpus_per_raas: Annotated[
        float, typer.Option("--gpus-per-raas", min=0, help="GPUs per RaaS worker.")
    ] = 0.0,
    gpu_resource: Annotated[
        str,
        typer.Option(
            "--gpu-resource", help="The Ray resource GPUs are counted in (a custom one stands in for GPUs)."
        ),
    ] = "GPU",
    cpus_per_role: Annotated[
        float, typer.Option("--cpus-per-role", min=0, help="CPUs Ray reserves for each role's actor.")
    ] = 1.0,
    metrics_bind: Annotated[
        str, typer.Option("--metrics-bind", help="Serve Prometheus /metrics on HOST:PORT (default: off).")
    ] = "",
    offline: Annotated[
        bool, typer.Option("--offline", help="Set every library's offline switch in every role.")
    ] = False,
) -> None:
    """Run the recipe's roles as Ray actors (the driver supervises them, replaces dead workers and,
    with rollout.autoscale.enabled, scales the RaaS pool); exits 0 when every policy reached its budget.
    Under `ray job submit -- astraflow launch ray ...` it uses the job's RAY_ADDRESS. The same --run-dir
    resumes a run."""
    import importlib.util

    from astraflow.cluster.plan import absolute_models, make_plan, prepare_run
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.errors import AstraflowError
    from astraflow.rundir import default_run_dir

    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    absolute_models(r, Path.cwd())
    plan = make_plan(r, run_dir or default_run_dir(r), raas)
    scale = r.rollout.autoscale
    if scale.enabled and not scale.min <= len(plan.raas) <= scale.max:
        raise AstraflowError(
            f"{len(plan.raas)} starting RaaS workers is outside rollout.autoscale.min..max ({scale.min}..{scale.max})",
            hint="pass --raas N within the bounds, or change them",
        )
    if importlib.util.find_spec("ray") is None:
        raise AstraflowError("ray is not installed", hint="pip install 'astraflow[ray]'")
    names = [f"raas-{i}" for i in range(max(len(plan.raas), scale.max if scale.enabled else 0))]
    prepare_run(r, plan, raas_names=names)
    from astraflow import log
    from astraflow.cluster.ray_launch import run_on_ray
    from astraflow.cluster.ray_placement import RayOptions

    log.setup("launch")
    log.add_file(plan.run_dir / "logs" / "launch.log")

    opts = RayOptions(
        address=address,
        port=port,
        gpu_resource=gpu_resource,
        trainer_gpus=trainer_gpus,
        gpus_per_raas=gpus_per_raas,
        cpus_per_role=cpus_per_role,
        offline=offline,
        metrics_bind=metrics_bind,
    )
    typer.echo(f"run directory {plan.run_dir}; follow it with: astraflow status --run-dir {plan.run_dir}")
    raise typer.Exit(run_on_ray(r, plan, opts, names))


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
    from astraflow.cluster.slurm import SlurmOptions, render, render_worker
    from astraflow.cluster.slurm_pool import worker_script
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.errors import AstraflowError
    from astraflow.rundir import default_run_dir

    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    absolute_models(r, Path.cwd())
    plan = make_plan(r, run_dir or default_run_dir(r), raas)
    scale = r.rollout.autoscale
    if scale.enabled and not scale.min <= len(plan.raas) <= scale.max:
        raise AstraflowError(
            f"{len(plan.raas)} starting RaaS workers is outside rollout.autoscale.min..max ({scale.min}..{scale.max})",
            hint="pass --raas N within the bounds, or change them",
        )
    names = [f"raas-{i}" for i in range(max(len(plan.raas), scale.max if scale.enabled else 0))]
    opts = SlurmOptions(
        nodes=nodes or len(plan.trainers) + len(plan.raas),
        python=python or sys.executable,
        port=port,
        gpus_per_node=gpus_per_node,
        time=time_limit,
        partition=partition,
        offline=offline,
        autoscale=scale.enabled,
    )
    script = render(plan, opts)
    if dry_run:
        typer.echo(script, nl=False)
        if scale.enabled:
            typer.echo(f"\n# RUN/launch/{names[0]}.sbatch, one of the one-RaaS jobs the autoscaler submits:")
            typer.echo(render_worker(plan, opts, names[0]), nl=False)
        return
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise AstraflowError(
            "sbatch is not on PATH: this is not a Slurm login node",
            hint="run this on a node that submits jobs, or --dry-run to see the script",
        )
    prepare_run(r, plan, raas_names=names)
    path = plan.run_dir / "launch" / "slurm.sbatch"
    path.parent.mkdir(exist_ok=True)
    path.write_text(script)
    if scale.enabled:  # the one-RaaS jobs the autoscaler submits
        for name in names:
            (plan.run_dir / worker_script(name)).write_text(render_worker(plan, opts, name))
    out = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise AstraflowError(f"sbatch refused {path}: {out.stderr.strip()}", hint="see the script above it")
    job = out.stdout.strip().split(";")[0]
    typer.echo(f"submitted job {job}: {path}")
    typer.echo(f"run directory {plan.run_dir}; follow it with: astraflow status --run-dir {plan.run_dir}")


@app.command("k8s")
def k8s(
    recipe: Annotated[str, typer.Argument(help="Recipe TOML file.")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the manifests (a kustomize base) and keys.")
    ],
    image: Annotated[str, typer.Option("--image", help="Container image with astraflow installed.")],
    set_: SetOpt = None,
    name: Annotated[
        str, typer.Option("--name", help="Prefix of every object's name (default: the run's name).")
    ] = "",
    namespace: Annotated[str, typer.Option("--namespace", help="Namespace of every object.")] = "",
    raas: Annotated[
        int | None, typer.Option("--raas", min=1, help="RaaS replicas (default rollout.local_workers).")
    ] = None,
    raas_max: Annotated[
        int | None,
        typer.Option(
            "--raas-max", min=1, help="Worker keys made: the most replicas `kubectl scale` may set."
        ),
    ] = None,
    gpus_per_raas: Annotated[
        int, typer.Option("--gpus-per-raas", min=0, help="nvidia.com/gpu per RaaS pod.")
    ] = 0,
    trainer_gpus: Annotated[
        bool, typer.Option("--trainer-gpus", help="One nvidia.com/gpu per trainer rank.")
    ] = False,
    storage: Annotated[
        str, typer.Option("--storage", help="Controller and checkpoint volume size.")
    ] = "10Gi",
    models_claim: Annotated[
        str,
        typer.Option(
            "--models-claim",
            help="PersistentVolumeClaim holding the models: mounted at /models, each policy's model read "
            "from /models/<its directory name>. Without it the image must hold the recipe's model paths.",
        ),
    ] = "",
    offline: Annotated[
        bool, typer.Option("--offline", help="Set every library's offline switch in every pod.")
    ] = False,
    metrics: Annotated[
        bool,
        typer.Option(
            "--metrics",
            help="Serve Prometheus /metrics beside the controller (port 9600; on with rollout.autoscale.enabled).",
        ),
    ] = False,
) -> None:
    """Write Kubernetes manifests for a run (apply with `kubectl apply -k OUT`) and the run's keys."""
    import re

    from astraflow.cluster.k8s import K8sOptions, write
    from astraflow.cluster.plan import make_plan
    from astraflow.config.load import dump_resolved, load_recipe, validate_plugins
    from astraflow.errors import AstraflowError
    from astraflow.launch.up import throwaway_keys

    r = load_recipe(recipe, set_ or [])
    validate_plugins(r, torch_plugins=False)
    prefix = name or f"af-{r.run.name}".lower().replace("_", "-")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", prefix):
        raise AstraflowError(
            f"{prefix!r} is not a usable Kubernetes name prefix",
            hint="pass --name with lowercase letters, digits and '-' (at most 40)",
        )
    if models_claim:
        for pol in r.policy:
            pol.model = f"/models/{Path(pol.model).name}"
    plan = make_plan(r, out, raas)
    scale = r.rollout.autoscale if r.rollout.autoscale.enabled else None
    keys_max = max(raas_max or 0, len(plan.raas), scale.max if scale else 0)
    raas_names = [f"raas-{i}" for i in range(keys_max)]
    out.mkdir(parents=True, exist_ok=True)
    dump_resolved(r, plan.resolved)
    throwaway_keys(
        plan.keys,
        [(m.name, m.role, m.policy) for m in plan.trainers]
        + [(n, "raas", None) for n in raas_names]
        + [("observer", "observer", None), ("operator", "operator", None)],
    )
    opts = K8sOptions(
        name=prefix,
        image=image,
        namespace=namespace,
        gpus_per_raas=gpus_per_raas,
        trainer_gpus=trainer_gpus,
        storage=storage,
        models_claim=models_claim,
        offline=offline,
        metrics=metrics,
        autoscale=scale,
        drain_timeout_s=r.rollout.drain_timeout_s,
        run_name=r.run.name,
    )
    for path in write(plan, opts, plan.run_dir, raas_names):
        typer.echo(f"wrote {path}")
    typer.echo(
        f"keys in {plan.keys} (secrets.yaml holds them: keep it private); apply: kubectl apply -k {out}"
    )

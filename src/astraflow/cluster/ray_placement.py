"""Where and how each role of `launch ray` starts: its `astraflow` command line, its environment, the
resources its actor reserves and, for a role with GPUs, its placement group.

A role that needs GPUs gets a placement group of one bundle (its CPUs and GPUs on one node), made once
per member and kept across restarts so a replacement lands on the same reservation; a trainer's ranks
run under torchrun inside its actor. Ray is not asked to restart actors itself (max_restarts 0): a
restarted actor would rerun its constructor, not the role, so the driver replaces it
(launch/restarts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astraflow.cluster.plan import Member, Plan
from astraflow.cluster.slurm import OFFLINE_ENV
from astraflow.errors import AstraflowError
from astraflow.launch.restarts import MAX_RAAS_RESTARTS


@dataclass(frozen=True)
class RayOptions:
    """How the run is placed on the Ray cluster; everything else comes from the recipe."""

    address: str = ""
    """Ray cluster to attach to ('': RAY_ADDRESS, else the one `ray start` last started on this
    machine, else a new local cluster that ends with the run)."""
    port: int = 0
    """The controller's TCP port on its node (0: a free port)."""
    gpu_resource: str = "GPU"
    """The Ray resource GPUs are counted in (a custom name stands in for GPUs, as in the tests)."""
    trainer_gpus: bool = False
    """One GPU resource per trainer rank (policy.trainer_nproc of them per trainer)."""
    gpus_per_raas: float = 0.0
    """GPU resources per RaaS worker."""
    cpus_per_role: float = 1.0
    """CPUs Ray reserves for each role's actor."""
    offline: bool = False
    """Set every library's offline switch in every role."""
    max_restarts: int = MAX_RAAS_RESTARTS
    """Replacements of one RaaS worker before it is given up on (launch/restarts.py)."""
    start_timeout_s: float = 300.0
    """Longest wait for a placement group or the controller to come up."""
    stop_grace_s: float = 60.0
    """Seconds the controller and workers get to stop by themselves once the trainers are done."""
    metrics_bind: str = ""
    """HOST:PORT of the Prometheus /metrics endpoint the driver serves ('' : none)."""


class Placement:
    """The command, environment and Ray resources of each role of one run."""

    def __init__(self, ray: Any, plan: Plan, opts: RayOptions) -> None:
        self.ray = ray
        self.plan = plan
        self.opts = opts

    def env(self, member: Member) -> dict[str, str]:
        """Variables of one role's process."""
        from astraflow.metrics.role_stats import STATS_ENV

        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["TOKENIZERS_PARALLELISM"] = "false"
        if self.opts.offline:
            env.update(OFFLINE_ENV)
        if member.role == "raas":
            env[STATS_ENV] = str(self.plan.run_dir / "logs" / f"{member.name}.stats.jsonl")
        return env

    def argv(self, m: Member, address: str) -> list[str]:
        """The role's `astraflow` arguments (the same as `up` and `launch slurm` give it) for a
        controller at `address`."""
        keys, run_dir = self.plan.keys, self.plan.run_dir
        if m.role == "controller":
            bind = f"tcp://0.0.0.0:{self.opts.port}"  # members get its node's address
            return ["controller", str(self.plan.resolved), "--run-dir", str(run_dir), "--bind", bind]
        args = ["join", "--role", m.role, "--controller", address, "--member-id", m.name]
        args += ["--key", str(self.plan.secret(m.name)), "--controller-key", str(keys / "controller.key")]
        args += ["--connect-timeout", "600"]
        if m.role == "raas":
            return [*args, "--slots", str(self.plan.slots)]
        args += ["--policy", str(m.policy), "--checkpoint-dir", str(run_dir / "checkpoints" / str(m.policy))]
        args += ["--keys", str(keys)]
        return args + (["--nproc", str(m.nproc)] if m.nproc > 1 else [])

    def gpus(self, m: Member) -> float:
        """GPU resources of a role."""
        if m.role == "trainer":
            return float(m.nproc) if self.opts.trainer_gpus else 0.0
        return self.opts.gpus_per_raas if m.role == "raas" else 0.0

    def actor_options(self, m: Member, pg: Any, timeout_s: float) -> tuple[dict[str, Any], Any]:
        """The actor's options (its CPUs, and for a GPU role its placement group) and the placement
        group (`pg` when the member has one already, else a new one, or None without GPUs)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {"num_cpus": self.opts.cpus_per_role, "max_concurrency": 4, "max_restarts": 0}
        gpus = self.gpus(m)
        if not gpus:
            return opts, pg
        if pg is None:
            pg = self.placement_group(m.name, gpus, timeout_s)
        res = self.opts.gpu_resource
        opts.update(num_gpus=gpus) if res == "GPU" else opts.update(resources={res: gpus})
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0
        )
        return opts, pg

    def placement_group(self, name: str, gpus: float, timeout_s: float) -> Any:
        """One bundle (the role's CPUs and GPUs on one node), reserved before the actor is placed."""
        from ray.util.placement_group import placement_group, remove_placement_group

        res = self.opts.gpu_resource
        largest = max(
            (float(n.get("Resources", {}).get(res, 0)) for n in self.ray.nodes() if n.get("Alive")),
            default=0.0,
        )
        if largest < gpus:
            raise AstraflowError(
                f"{name} needs {gpus:g} {res} on one node; the largest node of the Ray cluster has {largest:g}",
                hint="add a node with more GPUs, lower policy.trainer_nproc or --gpus-per-raas, or name "
                "the resource your nodes declare with --gpu-resource",
            )
        pg = placement_group(
            [{"CPU": self.opts.cpus_per_role, res: gpus}], strategy="STRICT_PACK", name=f"astraflow-{name}"
        )
        try:
            self.ray.get(pg.ready(), timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise AstraflowError(
                f"no node could reserve {gpus:g} {res} for {name} within {timeout_s:.0f}s",
                hint="other jobs hold them; `ray status` shows what is used",
            ) from None
        return pg

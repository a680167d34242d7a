"""`astraflow launch slurm`: one batch job, one `srun` step per role, written as a script a person can
read and resubmit.

Placement: the trainers take the first nodes (one policy per node, its ranks under torchrun), the RaaS
workers the nodes after them, and the controller runs on the first node beside the first trainer (it
needs a CPU, not a GPU). With fewer nodes than roles, roles share nodes round-robin. Every step is
started with `--overlap` and the node's CPUs, so roles that share a node share its CPUs instead of
getting one each. The run directory must be on a filesystem every node sees; the job's state.db and
checkpoints live there, so submitting the same script again resumes the run where it stopped.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from astraflow.cluster.plan import Member, Plan

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "offline",
}
"""Every library's switch that keeps it off the network (`--offline`)."""


@dataclass(frozen=True)
class SlurmOptions:
    """How the job is shaped; everything else comes from the recipe."""

    nodes: int
    """Nodes of the job."""
    python: str
    """The Python (of an environment with astraflow installed) every node runs the roles with."""
    port: int
    """The controller's TCP port on the first node."""
    gpus_per_node: int = 0
    """GPUs per node (0: a CPU job). A trainer step gets its rank count, a RaaS step the whole node's."""
    time: str = ""
    """The job's time limit (sbatch --time), empty for the partition's default."""
    partition: str = ""
    """The partition (sbatch --partition), empty for the default one."""
    offline: bool = False
    """Set every library's offline switch in every role."""
    stop_grace_s: int = 60
    """Seconds the controller and workers get to stop by themselves once the trainers are done."""
    autoscale: bool = False
    """rollout.autoscale.enabled: the job runs the pool loop (cluster/slurm_pool.py), which submits
    the one-RaaS job scripts (render_worker) and drains workers."""


def _env(opts: SlurmOptions) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if opts.offline:
        env.update(OFFLINE_ENV)
    return env


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _node(index: int, nodes: int) -> str:
    return f'"${{NODES[{index % nodes}]}}"'


def _step(name: str, node: str, gpus: int, argv: list[str]) -> list[str]:
    """One srun line (continued over a few lines) that starts a role in the background."""
    opts = f'--nodes=1 --ntasks=1 --overlap --cpus-per-task="$CPUS" -w {node} --job-name={name}'
    if gpus:
        opts += f" --gpus={gpus}"
    return [
        f'srun {opts} --open-mode=append --output="$RUN/logs/{name}.log" \\',
        "    " + " ".join(argv) + " &",
    ]


def _member_argv(plan: Plan, m: Member) -> list[str]:
    argv = [
        '"$PY" -m astraflow join',
        f"--role {m.role}",
        '--controller "$CONTROLLER"',
        f"--member-id {_q(m.name)}",
        f'--key "$KEYS/members/{m.name}.key_secret"',
        '--controller-key "$KEYS/controller.key"',
        "--connect-timeout 600",
    ]
    if m.role == "trainer":
        argv += [
            f"--policy {_q(m.policy)}",
            f'--checkpoint-dir "$RUN/checkpoints/{m.policy}"',
            '--keys "$KEYS"',
        ]
        if m.nproc > 1:
            argv.append(f"--nproc {m.nproc}")
    else:
        argv.append(f"--slots {plan.slots}")
    return argv


def render(plan: Plan, opts: SlurmOptions) -> str:
    """The sbatch script of a run."""
    env = _env(opts)
    name = plan.run_dir.name
    head = [
        "#!/bin/bash",
        f"# astraflow run {name}, written by `astraflow launch slurm`.",
        f"# Resubmit this file to resume the run: sbatch {_q(plan.run_dir / 'launch' / 'slurm.sbatch')}",
        f"#SBATCH --job-name=astraflow-{name}",
        f"#SBATCH --nodes={opts.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --chdir={plan.run_dir}",
        f"#SBATCH --output={plan.run_dir}/logs/slurm-%j.out",
        "#SBATCH --open-mode=append",
    ]
    head += _resource_lines(opts)
    body = [
        "set -uo pipefail",
        f"RUN={_q(plan.run_dir)}",
        f"PY={_q(opts.python)}",
        'KEYS="$RUN/keys"',
        "export " + " ".join(f"{k}={_q(v)}" for k, v in env.items()),
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'CPUS="${SLURM_CPUS_ON_NODE:-1}"',
        f'CONTROLLER="tcp://${{NODES[0]}}:{opts.port}"',
        'echo "astraflow: job $SLURM_JOB_ID on ${NODES[*]}; controller $CONTROLLER"',
        "",
        "# the controller: the run's state (state.db in RUN: a resubmitted job resumes from it)",
        *_step(
            "controller",
            _node(0, opts.nodes),
            0,
            [
                '"$PY" -m astraflow controller "$RUN/recipe.resolved.json"',
                '--run-dir "$RUN"',
                f"--bind tcp://0.0.0.0:{opts.port}",
            ],
        ),
        "CONTROLLER_PID=$!",
        "TRAINER_PIDS=()",
        "RAAS_PIDS=()",
    ]
    gpus = opts.gpus_per_node
    for i, m in enumerate(plan.trainers):
        body += [
            "",
            f"# trainer of policy {m.policy}: {m.nproc} rank(s) under torchrun (FSDP2); "
            f"resumes from RUN/checkpoints/{m.policy}",
            *_step(m.name, _node(i, opts.nodes), m.nproc if gpus else 0, _member_argv(plan, m)),
            "TRAINER_PIDS+=($!)",
        ]
    for j, m in enumerate(plan.raas):
        body += [
            "",
            f"# rollout worker {m.name}",
            *_step(m.name, _node(len(plan.trainers) + j, opts.nodes), gpus, _member_argv(plan, m)),
            "RAAS_PIDS+=($!)",
        ]
    if opts.autoscale:
        steps = " ".join(f'--worker {m.name}="${{RAAS_PIDS[{j}]}}"' for j, m in enumerate(plan.raas))
        body += [
            "",
            "# the autoscaler (rollout.autoscale): adds a worker with `sbatch RUN/launch/raas-<i>.sbatch`",
            "# while work waits, drains one (Leave, as `astraflow ctl drain`) while the pool idles",
            '"$PY" -m astraflow.cluster.slurm_pool --run-dir "$RUN" --controller "$CONTROLLER" \\',
            f'    --controller-pid "$CONTROLLER_PID" {steps} &',
            "POOL_PID=$!",
        ]
    body += [
        "",
        "# the run is over when every trainer has exited; a controller that fails first ends the job",
        "# with its exit code, one that finished the run (exit 0) gives the trainers it told to stop time",
        "# to exit; the job's code is the first failure's (a trainer stopped after it does not replace it)",
        "status=0",
        "while :; do",
        "    live=0",
        '    for pid in "${TRAINER_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && live=1; done',
        '    [ "$live" = 0 ] && break',
        '    if ! kill -0 "$CONTROLLER_PID" 2>/dev/null; then',
        '        wait "$CONTROLLER_PID"',
        "        controller_status=$?",
        '        if [ "$controller_status" != 0 ]; then',
        '            echo "astraflow: the controller exited with $controller_status; stopping the job" >&2',
        '            status="$controller_status"',
        "            break",
        "        fi",
        f"        for _ in $(seq {opts.stop_grace_s}); do",
        "            live=0",
        '            for pid in "${TRAINER_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && live=1; done',
        '            [ "$live" = 0 ] && break',
        "            sleep 1",
        "        done",
        "        break",
        "    fi",
        "    sleep 2",
        "done",
        'for pid in "${TRAINER_PIDS[@]}"; do',
        '    if kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid"; fi',
        '    wait "$pid" || { code=$?; [ "$status" = 0 ] && status="$code"; }',
        "done",
        f"# the workers and the controller stop by themselves once the trainers are done (up to {opts.stop_grace_s}s);",
        "# then workers are drained (SIGTERM) before the controller stops",
        f"for _ in $(seq {opts.stop_grace_s}); do",
        "    live=0",
        '    for pid in "${RAAS_PIDS[@]}" "$CONTROLLER_PID"; do kill -0 "$pid" 2>/dev/null && live=1; done',
        '    [ "$live" = 0 ] && break',
        "    sleep 1",
        "done",
        'for pid in "${RAAS_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done',
        'for pid in "${RAAS_PIDS[@]}"; do wait "$pid"; done',
        'kill -TERM "$CONTROLLER_PID" 2>/dev/null',
        'wait "$CONTROLLER_PID"',
        *(
            ["# the autoscaler ends with the controller (its jobs still running get SIGTERM: they drain)"]
            + ['kill -TERM "$POOL_PID" 2>/dev/null', 'wait "$POOL_PID"']
            if opts.autoscale
            else []
        ),
        'echo "astraflow: job done, exit $status"',
        'exit "$status"',
    ]
    return "\n".join(head + [""] + body) + "\n"


def render_worker(plan: Plan, opts: SlurmOptions, name: str) -> str:
    """The script of a one-RaaS job the autoscaler submits (`sbatch SCRIPT tcp://NODE:PORT`, the
    controller's address as the argument): worker `name` with the run's keys and run directory. A
    drained worker exits 0, so its job ends COMPLETED."""
    run = plan.run_dir
    head = [
        "#!/bin/bash",
        f"# astraflow run {run.name}: rollout worker {name}, submitted by the run's autoscaler",
        f"# (cluster/slurm_pool.py) as: sbatch {_q(run / 'launch' / f'{name}.sbatch')} tcp://NODE:PORT",
        f"#SBATCH --job-name=astraflow-{run.name}-{name}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --exclusive",
        f"#SBATCH --chdir={run}",
        f"#SBATCH --output={run}/logs/{name}.log",
        "#SBATCH --open-mode=append",
    ]
    head += _resource_lines(opts)
    member = Member(name, "raas")
    body = [
        "set -uo pipefail",
        f"RUN={_q(run)}",
        f"PY={_q(opts.python)}",
        'KEYS="$RUN/keys"',
        'CONTROLLER="${1:?usage: sbatch THIS_SCRIPT tcp://CONTROLLER_NODE:PORT}"',
        "export " + " ".join(f"{k}={_q(v)}" for k, v in _env(opts).items()),
        'echo "astraflow: job $SLURM_JOB_ID: worker ' + name + ' of controller $CONTROLLER"',
        "# a drain (Leave) or SIGTERM: the worker finishes or hands back its tasks and exits 0",
        "exec " + " ".join(_member_argv(plan, member)),
    ]
    return "\n".join(head + [""] + body) + "\n"


def _resource_lines(opts: SlurmOptions) -> list[str]:
    """The #SBATCH lines of the options a user may leave unset (GPUs per node, time, partition)."""
    out = []
    if opts.gpus_per_node:
        out.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    if opts.time:
        out.append(f"#SBATCH --time={opts.time}")
    if opts.partition:
        out.append(f"#SBATCH --partition={opts.partition}")
    return out

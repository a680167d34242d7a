"""`astraflow controller` and `astraflow join --role raas|trainer`: one service per process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from astraflow.errors import AstraflowError

SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value.")]


def controller(
    recipe: Annotated[str, typer.Argument(help="Recipe TOML (or a resolved recipe JSON).")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory (state.db lives here).")],
    bind: Annotated[
        str | None, typer.Option("--bind", help="ROUTER endpoint, e.g. tcp://0.0.0.0:7600.")
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Run the controller: the run's state, task ledger, buffers and membership."""
    from astraflow import log
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.roles.controller import run_controller
    from astraflow.rundir import prepare

    log.setup("controller")
    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    prepare(run_dir, r)
    sys.exit(run_controller(r, run_dir, bind=bind))


def join(
    role: Annotated[str, typer.Option("--role", help="raas or trainer.")],
    controller: Annotated[
        str, typer.Option("--controller", help="Controller endpoint, e.g. tcp://HOST:7600.")
    ],
    policy: Annotated[
        list[str] | None, typer.Option("--policy", help="Policy to serve/train (repeatable for raas).")
    ] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="Override the recipe's engine plugin (raas).")
    ] = None,
    region: Annotated[str, typer.Option("--region", help="Free-form region label shown in status.")] = "",
    slots: Annotated[
        int | None, typer.Option("--slots", help="Concurrent tasks (raas); default from the recipe.")
    ] = None,
    member_id: Annotated[
        str | None, typer.Option("--member-id", help="Stable member id; default role-host-pid.")
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option("--checkpoint-dir", help="Trainer checkpoints (default ./checkpoints/<run>/<policy>)."),
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option("--advertise", help="Host RaaS workers use to reach this trainer's weight server."),
    ] = None,
    connect_timeout: Annotated[
        float, typer.Option("--connect-timeout", help="Seconds to wait for the controller's Welcome.")
    ] = 30.0,
    nproc: Annotated[
        int,
        typer.Option("--nproc", min=1, help="Trainer ranks on this machine (torchrun, FSDP2; one GPU each)."),
    ] = 1,
) -> None:
    """Join a running controller as a rollout worker (raas) or as one policy's trainer."""
    from astraflow import log

    if role == "raas":
        log.setup(member_id or "raas")
        from astraflow.roles.raas import run_raas

        sys.exit(
            run_raas(
                controller,
                policies=policy or [],
                engine=engine,
                region=region,
                slots=slots,
                member_id=member_id,
                connect_timeout_s=connect_timeout,
            )
        )
    if role == "trainer":
        log.setup(member_id or "trainer")
        if not policy or len(policy) != 1:
            raise AstraflowError("a trainer trains exactly one policy", hint="pass --policy NAME once")
        if nproc > 1:
            from astraflow.roles.trainer_ranks import exec_torchrun, world_from_env

            if world_from_env() == 1:
                exec_torchrun(nproc)
        from astraflow.roles.trainer import run_trainer

        sys.exit(
            run_trainer(
                controller,
                policy=policy[0],
                checkpoint_dir=checkpoint_dir,
                member_id=member_id,
                region=region,
                advertise=advertise,
                connect_timeout_s=connect_timeout,
            )
        )
    raise AstraflowError(f"unknown role {role!r}", hint="--role raas or --role trainer")

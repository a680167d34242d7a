"""`astraflow controller` and `astraflow join --role raas|trainer`: one service per process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
    keys: Annotated[
        Path | None,
        typer.Option("--keys", help="Key store (astraflow keys init); default <run-dir>/keys if it exists."),
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Allow a non-loopback --bind without keys (no authentication).")
    ] = False,
    allow_recipe_change: Annotated[
        bool,
        typer.Option(
            "--allow-recipe-change",
            help="On an existing run, accept a recipe that differs in operational fields only "
            "(timeouts, slots, controller settings, a larger run.steps); see docs/operations.md.",
        ),
    ] = False,
    plugins_checked: Annotated[
        bool,
        typer.Option(
            "--plugins-checked",
            hidden=True,
            help="Set by `astraflow up`, which has checked the engine and trainer options: skip that "
            "check here (it imports torch, seconds of the run's start-up on a small CPU).",
        ),
    ] = False,
) -> None:
    """Run the controller: the run's state, task ledger, buffers and membership."""
    from astraflow import log
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.config.recipe_change import check_run_recipe
    from astraflow.roles.controller import run_controller
    from astraflow.rundir import prepare
    from astraflow.shutdown import exit_process
    from astraflow.transport.security import set_server_keys

    log.setup("controller")
    r = load_recipe(recipe, set_ or [])
    validate_plugins(r, torch_plugins=not plugins_checked)
    set_server_keys(_controller_keys(keys, run_dir, bind or r.controller.bind, insecure))
    # before prepare() rewrites recipe.resolved.json: a refused recipe must leave the run as it was
    check_run_recipe(run_dir, r, allow=allow_recipe_change)
    prepare(run_dir, r)
    log.add_file(run_dir / "logs" / "controller.log")  # `astraflow logs` reads it, started by hand or by up
    exit_process(run_controller(r, run_dir, bind=bind, allow_recipe_change=allow_recipe_change))


def _controller_keys(keys: Path | None, run_dir: Path, bind: str, insecure: bool) -> Any:
    """The key store the controller authenticates with, or None; refuses an open bind without one."""
    from astraflow import log
    from astraflow.transport.keys import KeyStore

    if keys is not None:
        return KeyStore(keys)  # asked for explicitly: a missing store is an error, not "auth off"
    if KeyStore.exists(run_dir / "keys"):
        return KeyStore(run_dir / "keys")
    if not is_loopback(bind) and not insecure:
        raise AstraflowError(
            f"refusing to bind {bind} without authentication",
            hint=f"create keys: astraflow keys init --keys {run_dir / 'keys'} (docs/operations.md), "
            "or pass --insecure on a trusted network",
        )
    if not is_loopback(bind):
        log.get("controller").warning("binding %s WITHOUT authentication (--insecure)", bind)
    return None


def is_loopback(endpoint: str) -> bool:
    """Whether a zmq endpoint is reachable only from this machine (loopback tcp, ipc, inproc)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


KeyOpt = Annotated[
    Path | None,
    typer.Option("--key", help="This member's key file (NAME.key_secret from `astraflow keys new`)."),
]
ControllerKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--controller-key", help="The controller's public key: its controller.key file or Z85 text."
    ),
]


def member_credentials(key: Path | None, controller_key: str | None) -> Any:
    """Load and install this process's member credentials (None when neither flag is given)."""
    from astraflow.transport.keys import load_keypair, load_public
    from astraflow.transport.security import MemberCredentials, set_member_credentials

    if key is None and controller_key is None:
        return None
    if key is None or controller_key is None:
        raise AstraflowError(
            "--key and --controller-key go together",
            hint="pass this member's key file and the controller's key",
        )
    creds = MemberCredentials(keypair=load_keypair(key), controller_public=load_public(controller_key))
    set_member_credentials(creds)
    return creds


def _member_keys(
    key: Path | None, controller_key: str | None, keys: Path | None, member_id: str | None
) -> str | None:
    """Install this member's credentials and (a trainer's) pull keys; the member id, which is the
    key's name unless given."""
    from astraflow.transport.keys import KeyStore
    from astraflow.weights.server import set_pull_keys

    creds = member_credentials(key, controller_key)
    if creds is not None and member_id is None and creds.keypair.name:
        member_id = creds.keypair.name  # the key's name is the member id the controller expects
    if keys is not None:
        if creds is None:
            raise AstraflowError("--keys needs --key", hint="the weight server uses this member's key pair")
        set_pull_keys(KeyStore(keys))
    return member_id


def _trainer_ranks(policy: list[str] | None, nproc: int) -> None:
    """A trainer names one policy; with --nproc > 1 outside torchrun, this command runs again as its ranks."""
    if not policy or len(policy) != 1:
        raise AstraflowError("a trainer trains exactly one policy", hint="pass --policy NAME once")
    if nproc > 1:
        from astraflow.roles.trainer_ranks import exec_torchrun, world_from_env

        if world_from_env() == 1:
            exec_torchrun(nproc)  # the ranks run this command again, without --nproc


def join(
    role: Annotated[str, typer.Option("--role", help="raas or trainer.")],
    controller: Annotated[
        str | None, typer.Option("--controller", help="Controller endpoint, e.g. tcp://HOST:7600.")
    ] = None,
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
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            help="The run directory, where this machine sees it: the log goes to RUN/logs/<member>.log, a "
            "trainer's checkpoints to RUN/checkpoints/<policy> (default ~/.astraflow/runs/<run>/).",
        ),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint-dir",
            help="Trainer checkpoints (default RUN/checkpoints/<policy> with --run-dir, else "
            "~/.astraflow/runs/<run>/checkpoints/<policy>).",
        ),
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option(
            "--advertise",
            help="Host RaaS workers use to reach this trainer's weight server (announced, never bound).",
        ),
    ] = None,
    weights_bind: Annotated[
        str | None,
        typer.Option(
            "--weights-bind",
            help="Trainer: local address the weight server binds (default: the one that reaches the controller; 0.0.0.0 for all).",
        ),
    ] = None,
    weights_port: Annotated[
        int,
        typer.Option(
            "--weights-port", help="Trainer: fixed weight-server port, for firewalls (default: a free one)."
        ),
    ] = 0,
    connect_timeout: Annotated[
        float, typer.Option("--connect-timeout", help="Seconds to wait for the controller's Welcome.")
    ] = 30.0,
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
    keys: Annotated[
        Path | None,
        typer.Option(
            "--keys",
            help="Trainer: a copy of the controller's key store; only its member keys may pull weights.",
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option("--nproc", min=1, help="Trainer ranks on this machine (torchrun, FSDP2; one GPU each)."),
    ] = 1,
    controller_file: Annotated[
        Path | None,
        typer.Option(
            "--controller-file",
            hidden=True,
            help="Set by `astraflow up`, which starts members with the controller: import what the role "
            "needs, then read the controller's endpoint from this file once the controller wrote it.",
        ),
    ] = None,
) -> None:
    """Join a running controller as a rollout worker (raas) or as one policy's trainer."""
    from astraflow import log
    from astraflow.roles import member_files
    from astraflow.shutdown import exit_process

    if role not in ("raas", "trainer"):
        raise AstraflowError(f"unknown role {role!r}", hint="--role raas or --role trainer")
    if (controller is None) == (controller_file is None):
        raise AstraflowError(
            "pass the controller's endpoint with --controller", hint="e.g. --controller tcp://HOST:7600"
        )
    member_id = _member_keys(key, controller_key, keys, member_id)
    log.setup(member_id or role)
    # `up` sends each child's output to RUN/logs/<member>.log itself
    member_files.configure(run_dir, log_file=False if controller_file is not None else None)
    if role == "trainer":
        _trainer_ranks(policy, nproc)
    if controller_file is not None:
        from astraflow.launch.early_start import controller_from_file

        controller = controller_from_file(controller_file, role)
    assert controller is not None
    if role == "raas":
        from astraflow.roles.raas import run_raas

        exit_process(
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
        from astraflow.roles.trainer import run_trainer

        assert policy is not None  # checked above

        exit_process(
            run_trainer(
                controller,
                policy=policy[0],
                checkpoint_dir=checkpoint_dir,
                member_id=member_id,
                region=region,
                advertise=advertise,
                connect_timeout_s=connect_timeout,
                weights_bind=weights_bind,
                weights_port=weights_port,
            )
        )

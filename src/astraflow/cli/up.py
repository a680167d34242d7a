"""`astraflow up`: the whole run on this machine (controller, RaaS workers, trainers as children)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def up(
    recipe: Annotated[str, typer.Argument(help="Recipe TOML file.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Run directory (default runs/<name>-<time>/).")
    ] = None,
    no_dash: Annotated[
        bool,
        typer.Option(
            "--no-dash",
            help="Plain progress lines even on a terminal (the only output until the dashboard lands).",
        ),
    ] = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="Forbid every hub access in all roles (HF_*_OFFLINE=1).")
    ] = False,
) -> None:
    """Run a recipe end to end on this machine; exits 0 when every policy reaches its step budget."""
    from astraflow import log
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.launcher import run_up
    from astraflow.rundir import default_run_dir

    log.setup("up")
    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    sys.exit(run_up(r, run_dir or default_run_dir(r), offline=offline))

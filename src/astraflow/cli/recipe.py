"""`astraflow recipe check|show`: validate a recipe and print its resolved form."""

from __future__ import annotations

import json
from typing import Annotated

import typer

app = typer.Typer(help="Validate and inspect recipes.", no_args_is_help=True)

SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: a.b=value (repeatable).")]


@app.command("check")
def check(recipe: Annotated[str, typer.Argument(help="Recipe TOML file.")], set_: SetOpt = None) -> None:
    """Validate a recipe and every plugin it names; exit non-zero with the problems listed."""
    from astraflow.config.load import load_recipe, validate_plugins

    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    typer.echo(
        f"ok: {recipe} ({len(r.policy)} polic{'y' if len(r.policy) == 1 else 'ies'}, {r.run.steps} steps)"
    )


@app.command("show")
def show(recipe: Annotated[str, typer.Argument(help="Recipe TOML file.")], set_: SetOpt = None) -> None:
    """Print the resolved recipe (defaults filled, overrides applied) as JSON."""
    from astraflow.config.load import load_recipe

    r = load_recipe(recipe, set_ or [])
    typer.echo(json.dumps(r.model_dump(mode="json"), indent=2, sort_keys=True))

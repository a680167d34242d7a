"""The `astraflow` command: one executable for every role. Heavy imports live inside commands."""

from __future__ import annotations

import errno
import sqlite3
import sys
from typing import Annotated

import typer

from astraflow.cli import (
    bench,
    ctl,
    dash,
    doctor,
    keys,
    launch,
    leave,
    logs,
    metrics_serve,
    model,
    pack,
    plugins_cmd,
    recipe,
    report,
    roles,
    runs,
    sft,
    status,
    up,
)
from astraflow.errors import AstraflowError

app = typer.Typer(
    name="astraflow",
    help="Dataflow-oriented RL for LLM agents: controller, rollout workers (raas) and trainers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from astraflow import __version__

        typer.echo(f"astraflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Dataflow-oriented RL for LLM agents: controller, rollout workers (raas) and trainers."""


app.command("up")(up.up)
app.command("controller")(roles.controller)
app.command("join")(roles.join)
app.command("status")(status.status)
app.command("leave")(leave.leave)
app.command("plugins")(plugins_cmd.plugins)
app.command("dash")(dash.dash)
app.command("logs")(logs.logs)
app.command("runs")(runs.runs)
app.command("export")(report.export)
app.command("plot")(report.plot)
app.command("sft")(sft.sft)
app.command("doctor")(doctor.doctor)
app.command("pack")(pack.pack)
app.command("metrics-serve")(metrics_serve.metrics_serve)
app.add_typer(recipe.app, name="recipe")
app.add_typer(model.app, name="model")
app.add_typer(bench.app, name="bench")
app.add_typer(keys.app, name="keys")
app.add_typer(ctl.app, name="ctl")
app.add_typer(launch.app, name="launch")


def main() -> None:
    """Entry point: run the app and render user errors once, with their hint, without a traceback."""
    try:
        app()
    except AstraflowError as exc:
        typer.secho(f"error: {exc.message}", fg="red", err=True)
        if exc.hint:
            typer.echo(f"  hint: {exc.hint}", err=True)
        sys.exit(2)
    except sqlite3.DatabaseError as exc:
        # a damaged or foreign state.db (or another SQLite failure): which, not a traceback
        typer.secho(f"error: the run's state.db cannot be read: {exc}", fg="red", err=True)
        typer.echo(
            "  hint: is this an astraflow run directory? a damaged state.db cannot be repaired: restore a copy "
            "or start a new run directory",
            err=True,
        )
        sys.exit(2)
    except PermissionError as exc:
        # a read-only run directory, key store or output path: say which, not a traceback
        typer.secho(f"error: cannot write {exc.filename or 'a file'}: {exc.strerror}", fg="red", err=True)
        typer.echo(
            "  hint: pass a directory this user can write (--run-dir DIR) or fix its permissions", err=True
        )
        sys.exit(2)
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        typer.secho(
            f"error: cannot write {exc.filename or 'a file'}: read-only file system", fg="red", err=True
        )
        typer.echo("  hint: pass a directory on a writable file system (--run-dir DIR)", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)

"""`astraflow dash`: the live dashboard of a run directory or a controller (needs the `dash` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from astraflow.errors import AstraflowError

STOPPED_HERE = 3
"""Exit code of a dashboard that stopped the run (`up` then waits for the roles to finish)."""


def dash(
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Run directory to watch (live or finished).")
    ] = None,
    controller: Annotated[
        str | None, typer.Option("--controller", help="Live controller endpoint (status only).")
    ] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls.", min=0.2)] = 1.0,
    key: Annotated[
        Path | None,
        typer.Option(
            "--key",
            help="Key file (NAME.key_secret) for an authenticated controller; an operator "
            "key also enables the control keys. --run-dir of an `up` run finds its own.",
        ),
    ] = None,
    controller_key: Annotated[
        str | None, typer.Option("--controller-key", help="The controller's public key (file or Z85 text).")
    ] = None,
) -> None:
    """Show a run's curves, progress, members, events and samples (read-only; never blocks the controller)."""
    if (run_dir is None) == (controller is None):
        raise AstraflowError(
            "give exactly one of --run-dir or --controller",
            hint="astraflow dash --run-dir runs/<name>-<time>",
        )
    try:
        import textual  # noqa: F401
        import textual_plotext  # noqa: F401
    except ImportError as exc:
        raise AstraflowError(
            f"the dashboard needs textual and textual-plotext ({exc.name} is missing)",
            hint="textual is a dependency of astraflow: reinstall it (pip install 'textual>=0.60' textual-plotext)",
        ) from None
    from astraflow.transport.control_client import client_for
    from astraflow.transport.probe import parse_endpoint
    from astraflow.tui.app import Dashboard
    from astraflow.tui.source import ControllerSource, RunDirSource, Source

    if controller is not None:
        parse_endpoint(controller)  # a bad address is an error before the screen opens

    control = None
    if run_dir is None or (run_dir / "controller.addr").is_file():
        # a live run: the control keys talk to its controller (refusals show on the status line)
        try:
            control = client_for(run_dir, controller, key, controller_key)
            control.timeout_s = 5.0
        except AstraflowError:
            if run_dir is None or key is not None:
                raise
            # a run-dir from before operator keys: watch it; the control keys say they are off
            control = None
    source: Source = (
        RunDirSource(run_dir)
        if run_dir is not None
        else ControllerSource(controller or "", credentials=control.credentials if control else None)
    )
    app = Dashboard(source, interval_s=interval, control=control)
    try:
        app.run()
    finally:
        source.close()
    if app.stop_sent:
        # tells `up` the run was stopped from here: it lets the roles finish and exits 0
        raise typer.Exit(STOPPED_HERE)


def run_dash_bench(steps: int, seconds: float, interval_s: float) -> dict[str, float]:
    """`astraflow bench dash`'s measurements (the TUI is imported here, never by core code)."""
    from astraflow.tui.bench import run_bench

    return run_bench(steps, seconds, interval_s)

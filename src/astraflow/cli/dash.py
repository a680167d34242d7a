"""`astraflow dash`: the live dashboard of a run directory or a controller (needs the `dash` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from astraflow.errors import AstraflowError


def dash(
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Run directory to watch (live or finished).")
    ] = None,
    controller: Annotated[
        str | None, typer.Option("--controller", help="Live controller endpoint (status only).")
    ] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls.", min=0.2)] = 1.0,
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
            hint="pip install 'astraflow[dash]'",
        ) from None
    from astraflow.tui.app import Dashboard
    from astraflow.tui.source import ControllerSource, RunDirSource, Source

    source: Source = RunDirSource(run_dir) if run_dir is not None else ControllerSource(controller or "")
    try:
        Dashboard(source, interval_s=interval).run()
    finally:
        source.close()


def run_dash_bench(steps: int, seconds: float, interval_s: float) -> dict[str, float]:
    """`astraflow bench dash`'s measurements (the TUI is imported here, never by core code)."""
    from astraflow.tui.bench import run_bench

    return run_bench(steps, seconds, interval_s)

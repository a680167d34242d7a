"""`astraflow export` and `astraflow plot`: a run's numbers out of the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def export(
    run_dir_arg: Annotated[
        Path | None,
        typer.Argument(metavar="[RUN_DIR]", help="Run directory (or --run-dir).", show_default=False),
    ] = None,
    run_dir_opt: Annotated[Path | None, typer.Option("--run-dir", help="Run directory.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="csv, or parquet (needs pyarrow).")] = "csv",
    what: Annotated[
        str, typer.Option("--what", help="metrics (metrics.jsonl) or trajectories (state.db).")
    ] = "metrics",
    out: Annotated[
        Path | None, typer.Option("--out", help="Output file (default RUN_DIR/<what>.<format>).")
    ] = None,
    text: Annotated[
        bool,
        typer.Option(
            "--text/--no-text",
            help="Trajectories: also decode them with each policy's tokenizer (text, generated columns).",
        ),
    ] = True,
) -> None:
    """Write a run's metrics or trajectories as CSV or Parquet."""
    from astraflow.errors import AstraflowError
    from astraflow.metrics.export import export as do_export

    if (run_dir_arg is None) == (run_dir_opt is None):
        raise AstraflowError("give the run directory once", hint="astraflow export --run-dir runs/<name>")
    run_dir = run_dir_opt or run_dir_arg
    assert run_dir is not None
    _check_out(out)
    path, n = do_export(run_dir, what, fmt, out, text=text)
    typer.echo(f"wrote {n} rows to {path}")


def plot(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories to compare.")],
    metric: Annotated[str, typer.Option("--metric", help="Metric name (docs/metrics.md).")] = "reward_mean",
    out: Annotated[Path, typer.Option("--out", help="PNG file to write.")] = Path("plot.png"),
    policy: Annotated[str | None, typer.Option("--policy", help="Only this policy.")] = None,
    smooth: Annotated[int, typer.Option("--smooth", help="Running mean over this many steps.", min=1)] = 1,
) -> None:
    """Plot one metric of one or more runs against step into a PNG (needs matplotlib)."""
    from astraflow.metrics.plot import plot_runs

    _check_out(out)
    labels = plot_runs(run_dirs, metric, out, policy, smooth)
    typer.echo(f"wrote {out} ({len(labels)} curves: {', '.join(labels)})")


def _check_out(out: Path | None) -> None:
    """An --out whose directory does not exist is one line with a hint, not a traceback."""
    from astraflow.errors import AstraflowError

    if out is not None and not out.parent.is_dir():
        raise AstraflowError(
            f"no directory {out.parent} to write {out.name} into",
            hint="create it first, or pass --out FILE in an existing directory",
        )

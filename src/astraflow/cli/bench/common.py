"""What every `astraflow bench` command shares: the Typer app they register on, SIGTERM as Ctrl-C, --seeds."""

from __future__ import annotations

from typing import Any

import typer

app = typer.Typer(
    help="Benchmarks with ratios against a baseline measured in the same run.", no_args_is_help=True
)


def sigterm_as_interrupt(_signum: int, _frame: Any) -> None:
    """SIGTERM stops the bench like Ctrl-C: the running recipe's `astraflow up` is stopped first."""
    raise KeyboardInterrupt


def parse_seed_list(text: str | None) -> list[int] | None:
    """--seeds "0,1,2" as [0, 1, 2]; None when not given; a clear error on anything else."""
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise typer.BadParameter(f"--seeds takes distinct comma-separated integers, got {text!r}")
    return seeds

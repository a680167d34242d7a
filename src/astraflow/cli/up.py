"""`astraflow up`: the whole run on this machine (controller, RaaS workers, trainers as children)."""

from __future__ import annotations

import logging
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
            help="Plain progress lines even on a terminal (without it a terminal shows the dashboard).",
        ),
    ] = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="Forbid every hub access in all roles (HF_*_OFFLINE=1).")
    ] = False,
) -> None:
    """Run a recipe end to end on this machine; exits 0 when every policy reaches its step budget."""
    from astraflow import log
    from astraflow.config.load import load_recipe, validate_plugins
    from astraflow.launch.pool import check_bounds
    from astraflow.launch.up import run_up
    from astraflow.models.dirs import check_models
    from astraflow.rundir import default_run_dir
    from astraflow.shutdown import exit_process

    logger = log.setup("up")
    r = load_recipe(recipe, set_ or [])
    validate_plugins(r)
    check_bounds(r.rollout)
    check_models(r, source=Path(recipe))  # before the run directory: a missing model changes nothing
    rd = run_dir or default_run_dir(r)
    if no_dash or not wants_dashboard():
        exit_process(run_up(r, rd, offline=offline))
    # the dashboard owns the terminal: the launcher's own log lines go to logs/up.log meanwhile
    (rd / "logs").mkdir(parents=True, exist_ok=True)
    handlers = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    with open(rd / "logs" / "up.log", "a") as up_log:
        for h in handlers:
            h.setStream(up_log)
        try:
            code = run_up(r, rd, offline=offline, viewer=["dash", "--run-dir", str(rd)])
        finally:
            for h in handlers:
                h.setStream(sys.stderr)
    sys.stdout.write(summary(rd, code) + "\n")
    exit_process(code)


def wants_dashboard() -> bool:
    """A terminal on both ends and the dashboard's packages installed."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    import importlib.util

    if importlib.util.find_spec("textual") is None or importlib.util.find_spec("textual_plotext") is None:
        sys.stderr.write(
            "the dashboard needs textual (a dependency of astraflow: reinstall it); showing plain lines\n"
        )
        return False
    return True


def summary(run_dir: Path, code: int) -> str:
    """What the terminal keeps once the dashboard closed: each policy's last progress line."""
    import json

    from astraflow.launch.progress import progress_line
    from astraflow.launch.supervisor import tail_log
    from astraflow.metrics.log import MetricsLog

    last: dict[str, dict[str, object]] = {}
    evals: dict[str, dict[str, object]] = {}  # held-out eval rows come after the last step: kept apart
    for row in MetricsLog(run_dir / "metrics.jsonl").load_tail(1 << 16):
        if row.get("kind") in (None, "eval"):  # a late row adds metrics to a step already shown
            (evals if row.get("kind") == "eval" else last)[str(row.get("policy"))] = row
    resolved = json.loads((run_dir / "recipe.resolved.json").read_text())
    run_steps = int(resolved["run"]["steps"])
    budgets = {str(p["name"]): int(p.get("steps") or run_steps) for p in resolved.get("policy", [])}
    lines = [progress_line(row, budgets) for row in [*last.values(), *evals.values()]]
    verdict = "finished" if code == 0 else f"stopped (exit {code})"
    up_log = run_dir / "logs" / "up.log"
    if code not in (0, 130):  # a failure: what the launcher said went to its log while the dashboard ran
        lines.append(tail_log(up_log, 20))
    lines.append(f"run {verdict}; run directory {run_dir} (launcher log: {up_log})")
    return "\n".join(lines)

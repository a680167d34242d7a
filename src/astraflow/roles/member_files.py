"""Where a member started by `astraflow join` keeps its files: its log and, a trainer, its checkpoints.

With `--run-dir RUN` (the run directory, where this machine sees it: the controller's host or a shared
file system) they go where `astraflow up` puts them: `RUN/logs/<member>.log` and
`RUN/checkpoints/<policy>/`. Without it, the same layout under `~/.astraflow/runs/<run>/`, never
relative to the working directory. The log file is written with `--run-dir`, or without it when
stderr is a terminal; a member whose output is already sent somewhere (by `up`, Slurm, Kubernetes or a
shell redirect) logs only there.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from astraflow import log

_run_dir: Path | None = None
_log_file = False


def configure(run_dir: Path | None, *, log_file: bool | None = None) -> None:
    """Set this process's run directory (None: unknown) and whether it writes a log file (None: with
    a run directory, or when stderr is a terminal)."""
    global _run_dir, _log_file
    _run_dir = run_dir
    _log_file = (run_dir is not None or sys.stderr.isatty()) if log_file is None else log_file


def root(run_name: str) -> Path:
    """The run directory, or ~/.astraflow/runs/<run> when none was given."""
    return _run_dir if _run_dir is not None else Path.home() / ".astraflow" / "runs" / _safe(run_name)


def checkpoint_dir(run_name: str, policy: str) -> Path:
    """A trainer's default checkpoint directory: <root>/checkpoints/<policy>."""
    return root(run_name) / "checkpoints" / _safe(policy)


def open_log(member_id: str, run_name: str) -> Path | None:
    """Start writing this member's log to <root>/logs/<member>.log (None: no log file, or it cannot be
    written, which is said once and is not fatal)."""
    if not _log_file:
        return None
    path = root(run_name) / "logs" / f"{_safe(member_id)}.log"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        log.add_file(path)
    except OSError as exc:
        log.get("member").warning("no log file %s: %s", path, exc.strerror or exc)
        return None
    return path


def _safe(name: str) -> str:
    """A name as one path component (run and policy names are validated already; member ids may hold
    a host name)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"

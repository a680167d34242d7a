"""The run directory: state.db, recipe.resolved.json, metrics.jsonl, checkpoints/, logs/."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from astraflow import __version__
from astraflow.config.load import dump_resolved
from astraflow.config.recipe import Recipe
from astraflow.errors import AstraflowError


def default_run_dir(recipe: Recipe) -> Path:
    """runs/<name>-<time>/ under the current directory."""
    return Path("runs") / f"{recipe.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def git_sha() -> str:
    """The git commit of the code running, or '' outside a checkout."""
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def prepare(run_dir: Path, recipe: Recipe) -> Path:
    """Create the run directory layout and record the resolved recipe, versions and git SHA.

    RunDirError (one line and a hint) when the directory cannot be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # the run's state, logs and checkpoints are its owner's alone, whatever the umask
        os.chmod(run_dir, 0o700)
        (run_dir / "logs").mkdir(mode=0o700, exist_ok=True)
        (run_dir / "checkpoints").mkdir(mode=0o700, exist_ok=True)
        dump_resolved(recipe, run_dir / "recipe.resolved.json")
        meta_path = run_dir / "meta.json"
        if not meta_path.exists():  # `up` and then its controller both prepare: one `git` call is enough
            meta = {"astraflow": __version__, "git_sha": git_sha(), "created": time.time()}
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as exc:
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {exc.strerror or exc}",
            hint="pass --run-dir DIR on a writable file system (a path this user may create)",
        ) from None
    return run_dir


class RunDirError(AstraflowError):
    """The run directory cannot be created or written."""

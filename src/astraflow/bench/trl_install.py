"""TRL for `astraflow bench trl`, installed on first use into a cache directory: `pip install --target
... --no-deps` of exactly the packages pip says this environment lacks, so torch and transformers are
not fetched again. TRL is not a dependency of astraflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from astraflow.errors import AstraflowError

TRL_VERSION = "1.16.0"
"""The TRL release the bench installs by default (the one its numbers were recorded with)."""


def default_cache() -> Path:
    """Where TRL is installed: $ASTRAFLOW_CACHE or ~/.cache/astraflow, then trl-<version>/."""
    return Path(os.environ.get("ASTRAFLOW_CACHE", Path.home() / ".cache" / "astraflow"))


def _pip(args: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip; a failure becomes one clear error."""
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AstraflowError(
            f"could not {what}: {exc}", hint="install TRL by hand and pass its directory with --trl-path"
        ) from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise AstraflowError(
            f"could not {what}: pip exited {proc.returncode}: {' | '.join(tail)}",
            hint="TRL is installed on first use and needs the package index once; or install it by hand "
            "(pip install --target DIR trl) and pass --trl-path DIR",
        )
    return proc


def ensure_trl(version: str, cache: Path) -> Path:
    """A directory holding TRL `version` and what it needs beyond this environment; installed on
    first use (pip resolves against this environment, so torch and transformers are not fetched)."""
    target = cache / f"trl-{version}"
    if (target / ".complete").is_file():
        return target
    print(f"installing trl=={version} into {target} (once; later runs reuse it)", file=sys.stderr)
    target.mkdir(parents=True, exist_ok=True)
    report = target / "pip-report.json"
    _pip(
        ["install", "--dry-run", "--quiet", "--report", str(report), f"trl=={version}"],
        f"resolve trl=={version}",
    )
    pins = [
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for item in json.loads(report.read_text()).get("install", [])
    ]
    if pins:
        _pip(
            ["install", "--quiet", "--no-deps", "--target", str(target), *pins],
            f"install {', '.join(pins)}",
        )
    (target / ".complete").write_text("\n".join(pins) + "\n")
    return target

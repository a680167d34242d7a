"""`astraflow logs`: every role's log of a run merged by time into one stream, each line prefixed with its role."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import IO, Annotated

import typer

from astraflow.errors import AstraflowError

_STAMP = re.compile(r"\d\d:\d\d:\d\d ")
"""The time every log line starts with (log.setup's format)."""


class LogFollower:
    """Reads new complete lines from every log file of a run directory (new files are picked up)."""

    def __init__(self, logs_dir: Path, role: str | None = None) -> None:
        self.logs_dir = logs_dir
        self.role = role
        self.offsets: dict[Path, int] = {}

    def files(self) -> list[Path]:
        """The run's log files, filtered by role (a name prefix: raas matches raas-0, raas-1)."""
        found = sorted(self.logs_dir.glob("*.log"))
        if self.role:
            found = [p for p in found if p.stem == self.role or p.stem.startswith(f"{self.role}-")]
        return found

    def read(self) -> list[tuple[str, str]]:
        """(log name, line) for every complete line written since the last call, merged by time."""
        out: list[tuple[str, str, str]] = []
        for path in self.files():
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[path] = start + end
            stamp = ""
            for line in data[:end].decode("utf-8", "replace").splitlines():
                # a line without its own time (a traceback's) stays after the line it belongs to
                stamp = line[:8] if _STAMP.match(line) else stamp
                out.append((stamp, path.stem, line))
        out.sort(key=lambda row: row[0])  # stable: one file's lines of one second keep their order
        return [(name, line) for _, name, line in out]


def write_lines(lines: list[tuple[str, str]], out: IO[str], width: int) -> None:
    """Print lines as `name | text` with the names aligned."""
    for name, line in lines:
        out.write(f"{name:<{width}} | {line}\n")
    out.flush()


def logs(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory whose logs/ to read.")] = Path(
        "."
    ),
    role: Annotated[
        str | None,
        typer.Option("--role", help="Only this role or child (controller, raas, trainer, raas-0)."),
    ] = None,
    follow: Annotated[
        bool, typer.Option("-f", "--follow", help="Keep printing new lines until Ctrl-C.")
    ] = False,
) -> None:
    """Print every role's log of a run in one stream, prefixed with the role (children of `up`)."""
    logs_dir = run_dir / "logs"
    if not logs_dir.is_dir():
        raise AstraflowError(
            f"no logs/ in {run_dir}", hint="pass the run directory of a run: --run-dir runs/<name>-<time>"
        )
    follower = LogFollower(logs_dir, role)
    files = follower.files()
    if not files:
        have = ", ".join(p.stem for p in sorted(logs_dir.glob("*.log"))) or "none"
        raise AstraflowError(f"no log matches role {role!r} in {logs_dir}", hint=f"logs there: {have}")
    width = max(len(p.stem) for p in files)
    write_lines(follower.read(), sys.stdout, width)
    while follow:
        time.sleep(0.25)
        write_lines(follower.read(), sys.stdout, width)

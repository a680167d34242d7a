"""One logger for the project: plain lines on a pipe, the same lines with time on a TTY."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_CONFIGURED = False


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is when a line is emitted, not the stream of the
    moment it was made: a caller that swaps stderr for a while (a test's capture, an in-process CLI
    runner) and closes its stand-in leaves the log writing to the real one again. `setStream(f)` still
    sends it to `f` (`up` sends the launcher's lines to logs/up.log under the dashboard) until
    `setStream(sys.stderr)`."""

    def __init__(self) -> None:
        self._pinned: object = None
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr if self._pinned is None else self._pinned

    @stream.setter
    def stream(self, value: object) -> None:
        self._pinned = None if value is sys.stderr else value


def setup(role: str = "astraflow", level: str | None = None) -> logging.Logger:
    """Configure the root 'astraflow' logger once; every line is prefixed with the role."""
    global _CONFIGURED
    logger = logging.getLogger("astraflow")
    if not _CONFIGURED:
        handler = _Stderr()
        fmt = f"%(asctime)s {role} %(levelname).1s %(message)s"
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        _CONFIGURED = True
    logger.setLevel(level or os.environ.get("ASTRAFLOW_LOG_LEVEL", "INFO"))
    return logger


def add_file(path: Path) -> None:
    """Also write the log to path (a hand-started role's logs/<role>.log), unless stderr already goes there
    (`astraflow up` sends each child's stderr to that file)."""
    logger = logging.getLogger("astraflow")
    try:
        if path.exists() and os.path.samestat(os.fstat(sys.stderr.fileno()), path.stat()):
            return
    except (OSError, ValueError):
        pass  # stderr without a file descriptor (captured): write the file as well
    handler = logging.FileHandler(path, encoding="utf-8")
    stream = next((h for h in logger.handlers if isinstance(h, logging.StreamHandler)), None)
    if stream is not None and stream.formatter is not None:
        handler.setFormatter(stream.formatter)
    logger.addHandler(handler)


def get(name: str) -> logging.Logger:
    """A child logger of 'astraflow'."""
    return logging.getLogger(f"astraflow.{name}")

"""One logger for the project: plain lines on a pipe, the same lines with time on a TTY."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def setup(role: str = "astraflow", level: str | None = None) -> logging.Logger:
    """Configure the root 'astraflow' logger once; every line is prefixed with the role."""
    global _CONFIGURED
    logger = logging.getLogger("astraflow")
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        fmt = f"%(asctime)s {role} %(levelname).1s %(message)s"
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        _CONFIGURED = True
    logger.setLevel(level or os.environ.get("ASTRAFLOW_LOG_LEVEL", "INFO"))
    return logger


def get(name: str) -> logging.Logger:
    """A child logger of 'astraflow'."""
    return logging.getLogger(f"astraflow.{name}")

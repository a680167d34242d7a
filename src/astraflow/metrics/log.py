"""Reading metrics.jsonl incrementally: the newest rows first, older history on demand, then new rows.

A dashboard on a run of 10,000 steps must start at once: it reads the file's last bytes, shows them,
and loads the rest in the background; afterwards each poll reads only what was appended.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TAIL_BYTES = 256 << 10
"""Bytes read from the end of the file at start (about 200 rows of a typical run)."""


def _parse(data: bytes) -> list[dict[str, Any]]:
    out = []
    for line in data.split(b"\n"):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn or foreign line must not stop the reader
            if isinstance(rec, dict):
                out.append(rec)
    return out


class MetricsLog:
    """Incremental reader of one metrics.jsonl; `head` is where the not-yet-read history ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.head = 0
        self.offset = 0

    def load_tail(self, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
        """The complete rows in the file's last max_bytes; later `read_new` continues after them."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        start = max(0, size - max_bytes)
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(size - start)
        if start > 0:
            cut = data.find(b"\n") + 1  # the first line may begin before `start`
            data, start = data[cut:], start + cut
        end = data.rfind(b"\n") + 1  # a last line without newline is still being written
        self.head, self.offset = start, start + end
        return _parse(data[:end])

    def read_history(self) -> list[dict[str, Any]]:
        """The rows before those `load_tail` read (empty once read)."""
        if self.head == 0:
            return []
        with open(self.path, "rb") as f:
            data = f.read(self.head)
        self.head = 0
        return _parse(data)

    def read_new(self) -> list[dict[str, Any]]:
        """Complete rows appended since the last read."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return _parse(data[:end])


def read_all(path: Path) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl (for export, plots and `runs`)."""
    log = MetricsLog(path)
    return log.read_new()

"""Example third-party metric sink: every metrics row the controller records, copied to a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from astraflow.metrics.sinks import MetricSink, SinkConfig


class CopyRowsConfig(SinkConfig):
    """Options of the copy_rows sink."""

    file: str = "copied-metrics.jsonl"
    """File name inside the run directory."""


class CopyRowsSink(MetricSink):
    """Appends each row, as received, to RUN/<file>."""

    Config = CopyRowsConfig
    config: CopyRowsConfig

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self.path = run_dir / self.config.file

    def write(self, row: dict[str, Any]) -> None:
        """One JSON line per row."""
        with self.path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")

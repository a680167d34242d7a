"""The built-in metric sinks: metrics.jsonl, a wide SQLite table, TensorBoard event files."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import IO, Any

from astraflow.errors import PluginError
from astraflow.metrics.sinks import MetricSink, SinkConfig


class JsonlSink(MetricSink):
    """Appends one JSON object per step to RUN/metrics.jsonl (docs/metrics.md)."""

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        path = run_dir / "metrics.jsonl"
        _cut_torn_line(path)
        self.file: IO[str] = open(path, "a")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        """One line, flushed at once so readers (`up`, the dashboard) see the step immediately."""
        self.file.write(json.dumps(row, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        """Close the file."""
        self.file.close()


def _cut_torn_line(path: Path) -> None:
    """Drop a last line without its newline (a writer killed mid-line), so the next row starts a line
    of its own; the step it held is rewritten from state.db (metrics/recovery.py)."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        back = min(size, 1 << 20)
        f.seek(size - back)
        tail = f.read(back)
        if not tail or tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n") + 1
        if cut == 0 and back < size:
            return  # a last line over 1 MiB: not a row this sink wrote; leave it
        f.truncate(size - back + cut)


class SqliteSinkConfig(SinkConfig):
    """Options of the sqlite sink."""

    path: str = "metrics.db"
    """Database file, relative to the run directory."""


class SqliteSink(MetricSink):
    """One row per step in table `metrics` of RUN/metrics.db, one column per metric (new metrics add
    columns), for SQL over a run's curves; separate from state.db, which only the controller's state
    code writes."""

    Config = SqliteSinkConfig
    config: SqliteSinkConfig

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        from sqlite_utils import Database

        self.conn = sqlite3.connect(str(run_dir / self.config.path))
        self.db = Database(self.conn)

    def write(self, row: dict[str, Any]) -> None:
        """Insert the row, adding columns for metrics not seen before."""
        clean = {k: v for k, v in row.items() if isinstance(v, int | float | str)}
        self.db.table("metrics").insert(clean, alter=True)
        self.conn.commit()

    def close(self) -> None:
        """Close the database."""
        self.conn.close()


class TensorBoardSinkConfig(SinkConfig):
    """Options of the tensorboard sink."""

    logdir: str = "tensorboard"
    """Event-file directory, relative to the run directory (one subdirectory per policy)."""


class TensorBoardSink(MetricSink):
    """Scalars per policy and step as TensorBoard event files (needs the `tensorboardX` package)."""

    Config = TensorBoardSinkConfig
    config: TensorBoardSinkConfig

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise PluginError(
                "the tensorboard metric sink needs the tensorboardX package",
                hint="pip install 'astraflow[tensorboard]'",
            ) from exc
        self._writer_cls = SummaryWriter
        self.writers: dict[str, Any] = {}

    def write(self, row: dict[str, Any]) -> None:
        """Every number of the row as a scalar at the row's step."""
        policy = str(row.get("policy", "main"))
        w = self.writers.get(policy)
        if w is None:
            w = self.writers[policy] = self._writer_cls(str(self.run_dir / self.config.logdir / policy))
        step = int(row.get("step", 0))
        for k, v in row.items():
            if k not in ("step", "policy", "time") and isinstance(v, int | float):
                w.add_scalar(k, float(v), step, walltime=row.get("time"))
        w.flush()

    def close(self) -> None:
        """Close every policy's writer."""
        for w in self.writers.values():
            w.close()

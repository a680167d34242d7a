"""Metric sinks: the built-ins write what they say, a failing sink is switched off, bad names fail."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from astraflow.errors import PluginError
from astraflow.metrics.sinks import MetricSink, Sinks

ROWS = [
    {"policy": "main", "step": s, "version": s, "time": 1000.0 + s, "reward_mean": s / 10, "loss": -s / 100}
    for s in range(1, 4)
]


def test_jsonl_and_sqlite_sinks_record_every_row(tmp_path: Path) -> None:
    sinks = Sinks.from_specs([("sqlite", {"path": "m.db"})], tmp_path)
    assert set(sinks.sinks) == {"jsonl", "sqlite"}  # jsonl is always on
    for row in ROWS:
        sinks.write(row)
    sinks.write({**ROWS[-1], "step": 4, "kl": 0.5})  # a new metric adds a column
    sinks.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[:3] == ROWS and lines[3]["kl"] == 0.5
    with sqlite3.connect(tmp_path / "m.db") as db:
        got = db.execute("SELECT step, reward_mean, loss, kl FROM metrics ORDER BY step").fetchall()
    assert got == [(1, 0.1, -0.01, None), (2, 0.2, -0.02, None), (3, 0.3, -0.03, None), (4, 0.3, -0.03, 0.5)]


def test_tensorboard_sink_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    sinks = Sinks.from_specs([("tensorboard", {})], tmp_path)
    for row in ROWS:
        sinks.write(row)
    sinks.close()
    files = list((tmp_path / "tensorboard" / "main").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 100


class Broken(MetricSink):
    """Raises on its second row."""

    def __init__(self, config: Any, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self.n = 0

    def write(self, row: dict[str, Any]) -> None:
        self.n += 1
        if self.n == 2:
            raise RuntimeError("disk full")


def test_a_failing_sink_is_switched_off_and_the_others_go_on(tmp_path: Path) -> None:
    sinks = Sinks.from_specs([], tmp_path)
    sinks.sinks["broken"] = Broken(None, tmp_path)
    for row in ROWS:
        sinks.write(row)
    assert "broken" not in sinks.sinks
    sinks.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_unknown_sink_and_bad_options_fail_with_what_is_installed(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="no plugin named 'nope'.*") as err:
        Sinks.from_specs([("nope", {})], tmp_path)
    assert "sqlite" in (err.value.hint or "")
    from astraflow.config.load import validate_options
    from astraflow.errors import RecipeError

    with pytest.raises(RecipeError, match="metrics.sinks.0.options.pth"):
        validate_options("metric_sinks", "sqlite", {"pth": "x"}, "metrics.sinks.0.options")

"""Metric sinks: the built-ins write what they say, failures are loud (jsonl raises, optional sinks are
retried and reported), bad names fail."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from astraflow.errors import PluginError
from astraflow.metrics.sinks import MetricSink, SinkFailed, Sinks

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


def _copy_rows_sink(run_dir: Path, file: str) -> MetricSink:
    """The third-party example sink (tests/plugins/astraflow-example-sink), loaded from its source."""
    src = Path(__file__).resolve().parents[1] / "plugins" / "astraflow-example-sink" / "src"
    sys.path.insert(0, str(src))
    try:
        from astraflow_example_sink import CopyRowsConfig, CopyRowsSink
    finally:
        sys.path.remove(str(src))
    return CopyRowsSink(CopyRowsConfig(file=file), run_dir)


def test_a_failing_optional_sink_is_retried_with_backoff_reported_and_gets_every_row(tmp_path: Path) -> None:
    now = [0.0]
    events: list[tuple[str, str]] = []
    sinks = Sinks.from_specs([], tmp_path, report=lambda k, d: events.append((k, d)))
    sinks.clock = lambda: now[0]
    # a real fault: the sink's directory does not exist, so every open() fails until it is made
    sinks.sinks["copy_rows"] = _copy_rows_sink(tmp_path, "later/rows.jsonl")
    sinks.write(ROWS[0])
    assert [k for k, _ in events] == ["sink_failed"] and "FileNotFoundError" in events[0][1]
    assert "attempt 1, 1 rows waiting, next try in 1s" in events[0][1]
    sinks.write(ROWS[1])  # backing off: queued, not tried
    sinks.retry()
    assert len(events) == 1 and sinks.failing() == {"copy_rows": 2}
    now[0] = 1.0
    sinks.retry()  # tried again, fails again: the wait doubles
    assert len(events) == 2 and "attempt 2, 2 rows waiting, next try in 2s" in events[1][1]
    (tmp_path / "later").mkdir()
    now[0] = 2.5
    sinks.retry()
    assert len(events) == 2  # not yet due
    now[0] = 3.0
    sinks.write(ROWS[2])  # due: the waiting rows go first, in order
    assert events[-1][0] == "sink_recovered" and sinks.failing() == {}
    sinks.close()
    got = [json.loads(x) for x in (tmp_path / "later" / "rows.jsonl").read_text().splitlines()]
    assert got == ROWS
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ROWS


def test_rows_an_optional_sink_never_took_are_reported_at_close(tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []
    sinks = Sinks.from_specs([], tmp_path, report=lambda k, d: events.append((k, d)))
    sinks.sinks["copy_rows"] = _copy_rows_sink(tmp_path, "missing/rows.jsonl")
    for row in ROWS:
        sinks.write(row)
    sinks.close()
    assert events[-1] == ("sink_failed", "metric sink 'copy_rows': 3 rows never delivered (the run ended)")


def test_a_failing_jsonl_sink_raises(tmp_path: Path) -> None:
    # a real fault: metrics.jsonl on a full device (every flush fails with ENOSPC)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    sinks = Sinks.from_specs([], tmp_path)
    with pytest.raises(SinkFailed, match="metrics.jsonl cannot be written .*No space left on device"):
        sinks.write(ROWS[0])


def test_a_torn_last_line_is_cut_before_new_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1])[:20])
    sinks = Sinks.from_specs([], tmp_path)
    sinks.write(ROWS[2])
    sinks.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [ROWS[0], ROWS[2]]


def test_unknown_sink_and_bad_options_fail_with_what_is_installed(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="no plugin named 'nope'.*") as err:
        Sinks.from_specs([("nope", {})], tmp_path)
    assert "sqlite" in (err.value.hint or "")
    from astraflow.config.load import validate_options
    from astraflow.errors import RecipeError

    with pytest.raises(RecipeError, match="metrics.sinks.0.options.pth"):
        validate_options("metric_sinks", "sqlite", {"pth": "x"}, "metrics.sinks.0.options")


def test_a_metrics_jsonl_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").mkdir()  # a real fault: a directory where the file must be
    with pytest.raises(SinkFailed, match="metrics.jsonl cannot be opened .*IsADirectoryError") as err:
        Sinks.from_specs([], tmp_path)
    assert "restart the controller" in (err.value.hint or "")

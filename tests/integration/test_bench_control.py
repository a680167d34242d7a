"""`astraflow bench control`: a live controller, simulated members with their own CURVE keys, a table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_bench_control_moves_steps_through_a_live_controller_with_every_member_joined(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "bench",
            "control",
            "--members",
            "2,12",
            "--curve",
            "on",
            "--seconds",
            "2",
            "--warmup-steps",
            "1",
            "--procs",
            "2",
            "--tokens",
            "20",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert [r["workers"] for r in res["rows"]] == [2, 12]
    for row in res["rows"]:
        # every simulated member (and the trainer) joined under its own key, none was refused
        assert row["joined"] == row["members"] and row["refused"] == 0, row
        assert row["errors"] == [], row
        assert row["tokens"] == 20  # 20-token sequences passed every check of the controller
        # steps went through the controller: batches of the recipe's 32 x 16 sequences
        assert row["warmup_steps"] >= 1
        assert row["sequences_per_s"] > 0 and row["steps_per_s"] > 0
        assert row["controller_rss_mb"] > 0 and row["task_ms_p50"] is not None
        # the controller's CPU split by thread: its Python thread handled the steps; libzmq's I/O
        # thread (CURVE on) did some of the socket work; the parts are within the process's total
        # (read a moment apart, each to a clock tick: three ticks of slack over the window)
        assert row["main_ms_per_step"] > 0 and row["zmq_io_ms_per_step"] > 0, row
        parts = row["main_ms_per_step"] + row["zmq_io_ms_per_step"] + row["other_ms_per_step"]
        assert (
            parts <= row["controller_cpu_ms_per_step"] + 3 * 1000 / os.sysconf("SC_CLK_TCK") / row["steps"]
        ), row
        assert row["main_preempted_per_s"] >= 0, row
    assert res["rows"][1]["heartbeats_per_s"] > res["rows"][0]["heartbeats_per_s"]
    assert res["limits"]["zmq_msgpack_msgs_per_s"] > 0 and res["limits"]["rows_per_s_batched"] > 0


@pytest.mark.timeout(300)
def test_every_way_of_sending_results_is_accepted_whole_through_live_sockets(tmp_path: Path) -> None:
    """Results grouped, a TaskResult a task and a TaskResults a task, sent back to back under CURVE
    keys: a member's messages read in one poll are taken together (roles/controller/coalesce.py) and
    every result is acknowledged accepted, to the message that carried it."""
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "bench", "control", "--members", "2", "--curve", "on"]
        + ["--seconds", "2", "--warmup-steps", "1", "--settle-s", "0.5", "--procs", "1", "--results", "all"]
        + ["--json"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert [r["results"] for r in rows] == ["grouped", "single", "tasks"]
    for row in rows:
        assert row["refused"] == 0 and row["errors"] == [], row
        assert row["warmup_steps"] >= 1 and row["sequences_per_s"] > 0 and row["settle_s"] == 0.5, row

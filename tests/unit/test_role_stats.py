"""The counters behind `astraflow bench e2e`: a real engine's busy time and weight applications, a RaaS
stats file written and read back, and the report's window arithmetic over them."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.bench.e2e import format_report, read_e2e
from astraflow.engines.base import GenerationRequest
from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig
from astraflow.metrics.role_stats import PullStats, StatsWriter, raas_snapshot, read_stats
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("stats") / "m", seed=0)


def _generate(engine: TorchEngine, n: int, new: int) -> None:
    req = GenerationRequest(
        prompt_ids=[1, 5, 6], max_new_tokens=new, stop_ids=[], sampling=SamplingParams(temperature=1.0)
    )
    asyncio.run(engine.generate([req] * n))


def _settled(engine: TorchEngine, decode_steps: int) -> dict[str, Any]:
    """The engine's stats once its loop pass is counted: a completion is delivered before the pass ends."""
    deadline = time.monotonic() + 10
    while engine.stats()["decode_steps"] < decode_steps and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a pass counted too many would show now
    return engine.stats()


def test_engine_counts_busy_time_and_weight_applications(model_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(str(model_dir), TorchEngineConfig(max_batch=8), seed=0)
    try:
        _generate(engine, 4, 5)
        first = _settled(engine, 4)
        # 4 rows sampled 5 tokens: the first from the prefill, 4 decode steps of 4 rows
        assert first["decode_steps"] == 4 and first["row_steps"] == 16
        assert first["prefill_s"] > 0 and first["decode_s"] > 0 and first["n_applied"] == 0
        assert first["busy_s"] == pytest.approx(first["weight_s"] + first["prefill_s"] + first["decode_s"])
        # one admission of 4 rows of one prompt: one forward over one prompt
        assert (first["admissions"], first["admitted_rows"]) == (1, 4)
        assert (first["prefill_forwards"], first["prefill_prompts"]) == (1, 1)
        sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.load_weights(7, sd)
        _generate(engine, 2, 3)
        after = _settled(engine, 4 + 2)
        assert after["n_applied"] == 1 and after["applies"][0][0] == 7
        assert after["busy_s"] > first["busy_s"] and after["decode_steps"] == 4 + 2
        # idle between the two calls with nothing queued: that wait is counted as starved, not busy
        time.sleep(0.3)
        # a wait under way is counted up to the snapshot: snapshots' differences fall in their window
        assert engine.stats()["starved_s"] - after["starved_s"] >= 0.25
        _generate(engine, 1, 2)
        idle = _settled(engine, 4 + 2 + 1)
        assert idle["starved_s"] - after["starved_s"] >= 0.25
        assert idle["busy_s"] - after["busy_s"] < 0.25

        pulls = PullStats()
        pulls.add("main", 0.25, 0.05, 1000)
        writer = StatsWriter(str(tmp_path / "raas-0.stats.jsonl"))
        writer.maybe_write(raas_snapshot("raas-0", time.time(), {"main": engine}, pulls), force=True)
        writer.maybe_write(raas_snapshot("raas-0", time.time(), {"main": engine}, pulls))  # throttled
        lines = read_stats(tmp_path / "raas-0.stats.jsonl")
        assert len(lines) == 1
        main = lines[0]["engines"]["main"]
        recent = main["pulls"].pop("recent")
        assert main["version"] == 7 and main["pulls"] == {
            "pulls": 1,
            "fetch_s": 0.25,
            "load_s": 0.05,
            "bytes": 1000,
        }
        # each pull is listed with the wall time it was staged, so a window can count its own
        assert len(recent) == 1 and recent[0][1:] == [0.25, 0.05, 1000]
        assert abs(recent[0][0] - time.time()) < 60
    finally:
        engine.close()


def _run_dir(path: Path, rows: list[dict[str, object]], inserts: str = "") -> None:
    """A run directory as `up` leaves it: metrics.jsonl of `rows`, logs/, and a state.db with the
    tasks and trajectories tables `bench e2e` reads (`inserts`: SQL that fills them)."""
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "logs").mkdir()
    db = sqlite3.connect(path / "state.db")
    db.executescript(
        "CREATE TABLE tasks (id INTEGER PRIMARY KEY, updated REAL);"
        "CREATE TABLE trajectories (id INTEGER PRIMARY KEY, task_id INTEGER, policy TEXT, length INTEGER);"
        + inserts
    )
    db.commit()
    db.close()


def test_report_takes_the_steady_window(tmp_path: Path) -> None:
    # a run directory as `up` leaves it: two steps of one policy, a worker's stats lines around them
    t = 1000.0
    rows = [
        {"policy": "p", "step": 1, "version": 1, "time": t, "samples_generated": 100, "batch_size": 64,
         "trainer_compute_s": 9.0, "trainer_publish_s": 0.5, "reward_mean": 0.1},
        {"policy": "p", "step": 2, "version": 2, "time": t + 4, "samples_generated": 300, "batch_size": 64,
         "trainer_compute_s": 1.0, "trainer_wait_s": 2.0, "trainer_publish_s": 0.7, "reward_mean": 0.2},
    ]  # fmt: skip
    _run_dir(
        tmp_path,
        rows,
        f"INSERT INTO tasks VALUES (1, {t - 2}), (2, {t + 1}), (3, {t + 3});"
        "INSERT INTO trajectories (task_id, policy, length) VALUES (1, 'p', 9), (2, 'p', 5), (3, 'p', 7), (3, 'p', 8);",
    )

    def line(at: float, busy: float, pulls: int, applies: list[list[float]]) -> str:
        eng = {"version": 1, "busy_s": busy, "weight_s": 0.0, "prefill_s": 0.0, "decode_s": busy,
               "decode_steps": 10, "row_steps": 100, "applies": applies,
               "admitted_rows": 16 * busy, "prefill_forwards": 2 * busy,
               "pulls": {"pulls": pulls, "fetch_s": 0.3 * pulls, "load_s": 0.1 * pulls, "bytes": 10**6 * pulls}}  # fmt: skip
        return json.dumps({"time": at, "engines": {"p": eng}}) + "\n"

    (tmp_path / "logs/raas-0.stats.jsonl").write_text(
        line(t - 1, 5.0, 0, []) + line(t, 6.0, 0, []) + line(t + 4, 9.0, 1, [[2, t + 4.0, 0.2]])
    )
    rep = read_e2e(tmp_path)
    pol = rep["policies"]["p"]
    # three trajectories (20 tokens) came from tasks finished inside the window; one before it
    assert rep["window_s"] == 4.0 and pol["generated_per_s"] == 0.75 and pol["generated_tokens_per_s"] == 5.0
    assert pol["trained_per_s"] == 16.0
    assert pol["trainer_busy"] == 0.25  # the second step's compute over the 4 s between the steps
    eng = rep["workers"]["raas-0"]["engines"]["p"]
    assert eng["busy"] == 0.75 and eng["pulls"] == 1 and eng["lag_s"] == 0.0
    assert pol["weight_sync"]["total_s"] == pytest.approx(0.6 + 0.3 + 0.1 + 0.2)
    assert eng["prefill_per_row"] == 0.125  # 6 forwards for 48 rows admitted in the span
    assert "trainer busy" in format_report(rep) and "0.125 forwards/row" in format_report(rep)


def test_a_window_between_two_stats_lines_still_counts_its_pulls_and_busy_time(tmp_path: Path) -> None:
    # a loaded worker wrote no line inside the 1 s window [t, t + 1]: the lines around it span it, and
    # the pulls come from the later line's list of recent pulls, by their own times
    t = 2000.0
    rows = [
        {"policy": "p", "step": 1, "version": 1, "time": t, "batch_size": 8, "trainer_compute_s": 0.3,
         "trainer_publish_s": 0.01},
        {"policy": "p", "step": 2, "version": 2, "time": t + 1, "batch_size": 8, "trainer_compute_s": 0.3,
         "trainer_publish_s": 0.01},
    ]  # fmt: skip
    _run_dir(tmp_path, rows)
    recent = [
        [t - 0.5, 9.0, 9.0, 9],
        [t + 0.2, 0.02, 0.01, 100],
        [t + 0.7, 0.04, 0.03, 100],
        [t + 1.5, 9.0, 9.0, 9],
    ]

    def line(at: float, busy: float, n: int) -> str:
        eng = {"version": 1, "busy_s": busy, "weight_s": 0.0, "prefill_s": 0.0, "decode_s": busy,
               "decode_steps": 1, "row_steps": 1, "applies": [[2, t + 0.8, 0.01]],
               "pulls": {"pulls": n, "fetch_s": 0.0, "load_s": 0.0, "bytes": 0, "recent": recent[:n]}}  # fmt: skip
        return json.dumps({"time": at, "engines": {"p": eng}}) + "\n"

    (tmp_path / "logs/raas-0.stats.jsonl").write_text(line(t - 0.4, 1.0, 1) + line(t + 1.6, 2.0, 4))
    rep = read_e2e(tmp_path)
    eng = rep["workers"]["raas-0"]["engines"]["p"]
    assert rep["workers"]["raas-0"]["window_s"] == pytest.approx(2.0)  # the span of the two lines
    assert eng["busy"] == pytest.approx(0.5) and eng["applied"] == 1
    # the two pulls inside the window, not the ones before or after it
    assert (
        eng["pulls"] == 2 and eng["fetch_s"] == pytest.approx(0.03) and eng["load_s"] == pytest.approx(0.02)
    )
    sync = rep["policies"]["p"]["weight_sync"]
    assert sync["fetch_s"] == pytest.approx(0.03) and sync["total_s"] == pytest.approx(
        0.01 + 0.03 + 0.02 + 0.01
    )

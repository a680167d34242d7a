"""`astraflow bench dash` (through cli/dash.py): what the dashboard costs — start-up on a long run, one poll, and the
controller's state.db writes with a dashboard reading beside them — each against a baseline measured
in the same run."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def make_long_run(run_dir: Path, steps: int, recipe: dict[str, Any], row: dict[str, Any]) -> None:
    """A run directory of `steps` recorded steps: state.db through the real Store, metrics.jsonl rows
    shaped like `row` (one per step)."""
    from astraflow.state.store import Store

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "recipe.resolved.json").write_text(json.dumps(recipe))
    store = Store.open(run_dir / "state.db")
    try:
        store.init_run(recipe["run"]["name"], recipe)
        store.ensure_policy("main", 1)
        t0 = time.time() - steps
        with store.write():
            store.add_event("start", recipe["run"]["name"], now=t0)
            for step in range(1, steps + 1):
                store.record_version("main", step, step, "tcp://127.0.0.1:1")
                store.add_metrics("main", step, {"reward_mean": 0.5}, now=t0 + step)
        with open(run_dir / "metrics.jsonl", "w") as f:
            for step in range(1, steps + 1):
                f.write(json.dumps({**row, "step": step, "version": step, "time": t0 + step}) + "\n")
    finally:
        store.close()


def template_row() -> dict[str, Any]:
    """A metrics row with the names and number of keys a quickstart step writes."""
    keys = (
        "adv_abs_mean adv_mean adv_std approx_kl batch_size buffered clip_frac data/groups_dropped "
        "data/groups_kept data/prompts_skipped data/prompts_submitted dropped entropy expired grad_norm loss "
        "lr ratio_max ratio_mean ratio_min replayed reward_mean reward_std samples_generated samples_per_s "
        "sequences staleness_max staleness_mean tasks_done tasks_failed tasks_leased tasks_queued tokens "
        "trainer_step_s trainer_wait_s"
    ).split()
    return {"policy": "main", **{k: 0.123456789012345 for k in keys}}


def time_first_paint(run_dir: Path) -> tuple[float, float]:
    """(seconds from constructing the app to its first painted poll, seconds until the history is in)."""
    from astraflow.tui.app import Dashboard
    from astraflow.tui.source import RunDirSource

    async def main() -> tuple[float, float]:
        t0 = time.perf_counter()
        app = Dashboard(RunDirSource(run_dir))
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            first = app.first_paint_s or 0.0
            while not app.history_loaded:
                await pilot.pause(0.01)
            full = time.perf_counter() - t0
            await pilot.press("q")
        return first, full

    return asyncio.run(main())


COLD = """
import time
t0 = time.perf_counter()
import asyncio, sys
spawned = float(sys.argv[2])  # the parent's clock when it started this interpreter
from pathlib import Path
from astraflow.tui.app import Dashboard
from astraflow.tui.source import RunDirSource
imported = (time.time() - spawned, time.process_time())

async def main():
    app = Dashboard(RunDirSource(Path(sys.argv[1])))
    async with app.run_test(size=(160, 50)) as pilot:
        while app.first_frame_at is None:
            await pilot.pause(0.005)
        wall, cpu = app.first_frame_at
        print(time.time() - (time.perf_counter() - wall) - spawned, cpu, *imported)
        await pilot.press("q")

asyncio.run(main())
"""


def time_cold_start(run_dir: Path) -> tuple[float, float, float, float]:
    """(wall s, CPU s) from starting a fresh interpreter to the dashboard's first frame drawn with data
    (interpreter start-up and imports of textual and astraflow included), then (wall s, CPU s) of the
    interpreter and imports alone; CPU time is the fairer number on a loaded machine."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", COLD, str(run_dir), repr(time.time())],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    wall, cpu, imp_wall, imp_cpu = (float(x) for x in out.stdout.strip().splitlines()[-1].split())
    return wall, cpu, imp_wall, imp_cpu


def time_full_parse(path: Path) -> float:
    """Baseline: parse every row of metrics.jsonl (what a dashboard that read it all would do first)."""
    t0 = time.perf_counter()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows
    return time.perf_counter() - t0


def time_polls(run_dir: Path, n: int = 20) -> float:
    """Median seconds of one steady-state RunDirSource poll."""
    from astraflow.tui.source import RunDirSource

    src = RunDirSource(run_dir)
    src.poll()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        src.poll()
        times.append(time.perf_counter() - t0)
    src.close()
    return statistics.median(times)


def time_status_doc(run_dir: Path, n: int = 20) -> float:
    """Median seconds the controller spends building one StatusReply (its cost per dashboard poll)."""
    from astraflow.state.status import build_status
    from astraflow.state.store import Store

    store = Store.open_readonly(run_dir / "state.db")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        build_status(store)
        times.append(time.perf_counter() - t0)
    store.close()
    return statistics.median(times)


def writer_rate(run_dir: Path, seconds: float, reader_interval_s: float | None) -> float:
    """Write transactions per second (a version, a metrics row and an event each, as the controller
    writes per step) with or without a dashboard source polling beside them."""
    from astraflow.state.store import Store
    from astraflow.state.versions import newest_version
    from astraflow.tui.source import RunDirSource

    stop = threading.Event()

    def reader() -> None:
        src = RunDirSource(run_dir)
        while not stop.is_set():
            src.poll()
            stop.wait(reader_interval_s or 1.0)
        src.close()

    th = threading.Thread(target=reader, daemon=True) if reader_interval_s else None
    store = Store.open(run_dir / "state.db")
    base = newest_version(store) + 1
    if th is not None:
        th.start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        with store.write():
            store.record_version("main", base + n, base + n, "tcp://127.0.0.1:1")
            store.add_metrics("main", base + n, {"reward_mean": 0.5})
            store.add_event("bench", "write")
        n += 1
    rate = n / (time.perf_counter() - t0)
    stop.set()
    if th is not None:
        th.join()
    store.close()
    return rate


def run_bench(steps: int, seconds: float, interval_s: float) -> dict[str, float]:
    """Every measurement on a fresh synthetic run directory of `steps` steps."""
    recipe = {"run": {"name": "bench-dash", "steps": steps}, "policy": [{"name": "main", "model": ""}]}
    with tempfile.TemporaryDirectory(prefix="bench-dash-") as tmp:
        run_dir = Path(tmp) / "run"
        make_long_run(run_dir, steps, recipe, template_row())
        parse_s = time_full_parse(run_dir / "metrics.jsonl")
        first_s, full_s = time_first_paint(run_dir)
        cold_s, cold_cpu_s, import_s, import_cpu_s = min(time_cold_start(run_dir) for _ in range(3))
        poll_s = time_polls(run_dir)
        status_s = time_status_doc(run_dir)
        alone = writer_rate(run_dir, seconds, None)
        watched = writer_rate(run_dir, seconds, interval_s)
        stressed = writer_rate(run_dir, seconds, 0.05)
    return {
        "steps": steps,
        "full_parse_s": parse_s,
        "first_paint_s": first_s,
        "cold_start_s": cold_s,
        "cold_start_cpu_s": cold_cpu_s,
        "import_s": import_s,
        "import_cpu_s": import_cpu_s,
        "history_loaded_s": full_s,
        "poll_s": poll_s,
        "status_reply_s": status_s,
        "writes_per_s_alone": alone,
        "writes_per_s_dashboard": watched,
        "writes_per_s_20hz_reader": stressed,
    }

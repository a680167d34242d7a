"""The dashboard and the observability commands on a real run.

One short quickstart runs through `astraflow up` on a pseudo-terminal (so `up` shows the dashboard
and the test closes it with `q`), with a metric sink installed from outside astraflow. Textual's Pilot
then drives the dashboard headless against that finished run directory and against a live controller;
`logs`, `runs`, `export` and `plot` read the same directory.
"""

from __future__ import annotations

import asyncio
import csv
import fcntl
import importlib
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("textual")
pytest.importorskip("textual_plotext")

from astraflow.state.store import Store  # noqa: E402
from astraflow.tui.app import Dashboard  # noqa: E402
from astraflow.tui.source import ControllerSource, RunDirSource  # noqa: E402
from tests.conftest import install_isolated, uninstall_isolated  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SINK_PACKAGE = ROOT / "tests" / "plugins" / "astraflow-example-sink"
STEPS = 5


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows_of(path: Path) -> list[dict[str, Any]]:
    """The trainer-step rows (the quickstart also writes held-out eval rows, kind = "eval")."""
    return [r for r in rows_of(path) if r.get("kind") != "eval"]


def up_on_a_terminal(recipe: Path, run_dir: Path, steps: int, cwd: Path) -> tuple[int, str]:
    """Run `astraflow up` with a pseudo-terminal as stdin/stdout; press q once the last step is recorded."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env={**os.environ, "TERM": "xterm-256color"},
        start_new_session=True,
    )
    os.close(slave)
    out = bytearray()
    pressed = False
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            metrics = run_dir / "metrics.jsonl"
            if not pressed and metrics.is_file() and len(step_rows_of(metrics)) >= steps:
                os.write(master, b"q")
                pressed = True
            if proc.poll() is not None and not ready:
                break
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return rc, out.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def finished_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A finished quickstart run made by `up` on a terminal, with the example sink plugin on (installed
    into a folder of its own on PYTHONPATH while the module's tests run)."""
    tmp = tmp_path_factory.mktemp("dash")
    site = install_isolated(SINK_PACKAGE, tmp)
    recipe = tmp / "recipe.toml"
    recipe.write_text(
        f'extends = "{ROOT / "recipes/quickstart/recipe.toml"}"\n\n[run]\nsteps = {STEPS}\n\n'
        f'[[policy]]\nmodel = "{tiny_model}"\nbatch_prompts = 8\n\n'
        "[rollout]\nlocal_workers = 2\nslots = 8\n\n"  # two workers: the dashboard shows both
        '[metrics]\nsinks = [{ name = "copy_rows", options = { file = "copied.jsonl" } }]\n'
    )
    run_dir = tmp / "run"
    try:
        rc, screen = up_on_a_terminal(recipe, run_dir, STEPS, tmp)
        yield {"run_dir": run_dir, "rc": rc, "screen": screen, "tmp": tmp}
    finally:
        uninstall_isolated(site)


def test_up_on_a_terminal_shows_the_dashboard(finished_run: dict[str, Any]) -> None:
    screen = finished_run["screen"]
    assert finished_run["rc"] == 0, screen[-3000:]
    assert "\x1b[?1049h" in screen  # the dashboard took the alternate screen
    for text in ("Overview", "Members", "Samples", "ETA", "quickstart"):
        assert text in screen, text
    # closed after the last step: the terminal keeps the final line and the verdict
    assert f"step {STEPS}/{STEPS}" in screen.split("\x1b[?1049l")[-1]
    assert "run finished" in screen.split("\x1b[?1049l")[-1]
    # the launcher's own log went to a file instead of under the dashboard
    assert "every policy reached" in (finished_run["run_dir"] / "logs" / "up.log").read_text()


def test_sink_plugin_from_outside_receives_every_row(finished_run: dict[str, Any]) -> None:
    run_dir = finished_run["run_dir"]
    written = rows_of(run_dir / "metrics.jsonl")
    copied = rows_of(run_dir / "copied.jsonl")
    assert [r["step"] for r in written if r.get("kind") != "eval"] == list(range(1, STEPS + 1))
    assert copied == written


def drive(app: Dashboard, script: Any) -> Any:
    """Run a coroutine `script(pilot)` against the app headless."""

    async def main() -> Any:
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            return await script(pilot)

    return asyncio.run(main())


def cell_texts(app: Dashboard, table_id: str) -> list[list[str]]:
    from textual.widgets import DataTable

    table = app.query_one(table_id, DataTable)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def test_dashboard_on_a_finished_run(finished_run: dict[str, Any]) -> None:
    run_dir = finished_run["run_dir"]
    last = step_rows_of(run_dir / "metrics.jsonl")[-1]
    app = Dashboard(RunDirSource(run_dir))

    async def script(pilot: Any) -> dict[str, Any]:
        from textual.widgets import DataTable, Static, TabbedContent

        seen: dict[str, Any] = {}
        progress = str(app.query_one("#progress", Static).render())
        seen["progress"] = progress
        seen["reward_curve"] = app.series["main"].curve("reward_mean")
        seen["queues"] = cell_texts(app, "#queues")
        seen["counters"] = cell_texts(app, "#counters")
        await pilot.press("2")
        seen["tab2"] = app.query_one(TabbedContent).active
        seen["members"] = cell_texts(app, "#member-table")
        member_table = app.query_one("#member-table", DataTable)
        seen["member_styles"] = {
            str(member_table.get_row_at(i)[2].style) for i in range(member_table.row_count)
        }
        await pilot.press("3")
        seen["events"] = cell_texts(app, "#event-table")
        await pilot.press("4")
        for _ in range(100):  # the tokenizer loads in a worker thread
            await pilot.pause(0.05)
            if "generated" in str(app.query_one("#sample-detail", Static).render()):
                break
        seen["samples"] = cell_texts(app, "#sample-table")
        seen["detail"] = str(app.query_one("#sample-detail", Static).render())
        await pilot.press("down")
        await pilot.pause()
        seen["detail2"] = str(app.query_one("#sample-detail", Static).render())
        polls = app.polls
        await pilot.press("r")
        await pilot.pause(0.3)
        seen["polled_again"] = app.polls > polls
        await pilot.press("p")  # one policy: stays on it
        seen["policy"] = app.policy
        await pilot.press("1")
        seen["tab1"] = app.query_one(TabbedContent).active
        await pilot.press("q")
        return seen

    seen = drive(app, script)
    assert f"step {STEPS}/{STEPS}" in seen["progress"] and "run finished" in seen["progress"]
    assert f"reward {last['reward_mean']:.3f}" in seen["progress"]
    xs, ys = seen["reward_curve"]
    assert xs == [float(s) for s in range(1, STEPS + 1)] and ys[-1] == pytest.approx(last["reward_mean"])
    assert ["tasks done", str(last["tasks_done"])] in seen["queues"] or any(
        r[0] == "tasks done" for r in seen["queues"]
    )
    assert ["data/prompts_submitted", f"{last['data/prompts_submitted']:g}"] in seen["counters"]
    assert seen["tab2"] == "members" and seen["tab1"] == "overview"
    by_id = {r[0]: r for r in seen["members"]}
    store = Store.open_readonly(run_dir / "state.db")  # loaded, the run may end before raas-1 joins
    joined = {m["id"] for m in store.members()}
    store.close()
    raas = sorted(m for m in joined if m.startswith("raas-"))
    assert "trainer-main" in joined and raas and set(raas) <= {"raas-0", "raas-1"} and joined <= set(by_id)
    workers = [by_id[m] for m in raas]
    assert all(w[2] == "left" for w in workers)
    # tasks done by each worker ("-": none; one worker with free slots may have taken every task)
    done = [0 if w[8] == "-" else int(w[8]) for w in workers]
    assert sum(done) > 0
    assert "dim" in seen["member_styles"]  # members that left are greyed
    kinds = [r[1] for r in seen["events"]]
    assert kinds[0] == "start" and kinds.count("member_joined") >= len(joined) and "member_left" in kinds
    assert len(seen["samples"]) == 50
    assert "[context, mask 0]" in seen["detail"] and "[generated v" in seen["detail"]
    assert "copy" in seen["detail"]  # the prompt decoded by the policy's tokenizer, not token ids
    assert seen["detail2"] != seen["detail"]
    assert seen["polled_again"] and seen["policy"] == "main"


def test_dashboard_starts_from_the_tail_and_loads_history_after(finished_run: dict[str, Any]) -> None:
    """A long metrics file: the first poll reads only its last bytes; the rest comes as history."""
    run_dir = finished_run["tmp"] / "long"
    shutil.copytree(finished_run["run_dir"], run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    row = step_rows_of(run_dir / "metrics.jsonl")[-1]
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, 3001):
            f.write(json.dumps({**row, "step": step, "time": 1000.0 + step}) + "\n")
    src = RunDirSource(run_dir)
    first = src.poll().new_rows
    older = src.history()
    assert 0 < len(first) < 1000 and first[-1]["step"] == 3000
    assert [r["step"] for r in older + first] == list(range(1, 3001))
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({**row, "step": 3001}) + "\n" + '{"step": 3002, "polic')  # torn last line
    assert [r["step"] for r in src.poll().new_rows] == [3001]
    src.close()
    app = Dashboard(RunDirSource(run_dir))

    async def script(pilot: Any) -> list[float]:
        for _ in range(200):
            if app.history_loaded:
                break
            await pilot.pause(0.05)
        return app.series["main"].curve("reward_mean")[0]

    xs = drive(app, script)
    assert xs[0] == 1.0 and xs[-1] == 3001.0 and len(xs) == 400  # the whole history, thinned


def test_dashboard_on_a_live_controller(tiny_model: Path, tmp_path: Path) -> None:
    """A controller with no workers yet: the status document over the wire, and state.db read live."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'extends = "{ROOT / "recipes/quickstart/recipe.toml"}"\n\n[[policy]]\nmodel = "{tiny_model}"\n'
    )
    run_dir = tmp_path / "run"
    ctl = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "controller", str(recipe), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        addr_file = run_dir / "controller.addr"
        deadline = time.monotonic() + 60
        while not addr_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        addr = addr_file.read_text().strip()

        async def script(pilot: Any) -> tuple[str, str, str]:
            from textual.widgets import Static

            await pilot.pause(0.2)
            return (
                str(app.query_one("#progress", Static).render()),
                str(app.query_one("#status-line", Static).render()),
                app.title,
            )

        app = Dashboard(ControllerSource(addr), interval_s=0.5)
        progress, status, title = drive(app, script)
        assert "step 0/120" in progress and status == "" and "quickstart" in title
        assert "need --run-dir" in app.sub_title  # the panels the wire cannot fill say so
        # a control's outcome stays on the status line across polls
        app = Dashboard(ControllerSource(addr), interval_s=0.2)

        async def said(pilot: Any) -> tuple[str, str, str]:
            from textual.widgets import Static

            await pilot.pause(0.3)
            app.say("pause: done")
            polls = app.polls
            while app.polls < polls + 3:
                await pilot.pause(0.1)
            return ("", str(app.query_one("#status-line", Static).render()), "")

        _, status, _ = drive(app, said)
        assert status == "pause: done"
        app = Dashboard(RunDirSource(run_dir), interval_s=0.5)
        progress, status, _ = drive(app, script)
        assert "step 0/120" in progress and status == ""
    finally:
        ctl.terminate()
        ctl.wait(timeout=30)
    # the controller is gone: the dashboard says so instead of hanging
    app = Dashboard(ControllerSource(addr, timeout_s=1.0), interval_s=0.5)

    async def lost(pilot: Any) -> tuple[str, str, str]:
        while app.unreachable_since is None:
            await pilot.pause(0.1)
        await pilot.pause(0.1)
        return await script(pilot)

    progress, status, _ = drive(app, lost)
    assert "CONTROLLER UNREACHABLE" in status and "nothing listens" in status
    assert "no answer for" in progress


def cli(*args: str) -> SimpleNamespace:
    """Run the astraflow CLI in this process (as `main` does: a user error is exit 2 and `error:`)."""
    from typer.testing import CliRunner

    from astraflow.cli.main import app
    from astraflow.errors import AstraflowError

    r = CliRunner().invoke(app, list(args))
    if isinstance(r.exception, AstraflowError):
        return SimpleNamespace(returncode=2, stdout=r.stdout, stderr=f"error: {r.exception.message}")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return SimpleNamespace(returncode=r.exit_code, stdout=r.stdout, stderr="")


def test_logs_runs_export_plot(finished_run: dict[str, Any]) -> None:
    run_dir = finished_run["run_dir"]

    out = cli("logs", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    prefixes = {line.split(" | ")[0].strip() for line in out.stdout.splitlines()}
    assert {"controller", "raas-0", "raas-1", "trainer-main", "up"} <= prefixes
    out = cli("logs", "--run-dir", str(run_dir), "--role", "raas")
    assert {line.split(" | ")[0].strip() for line in out.stdout.splitlines()} == {"raas-0", "raas-1"}
    out = cli("logs", "--run-dir", str(run_dir), "--role", "nope")
    assert out.returncode == 2 and "error: no log matches role 'nope'" in out.stderr

    out = cli("runs", str(run_dir.parent), "--json")
    assert out.returncode == 0, out.stderr
    (run,) = [r for r in json.loads(out.stdout) if r["run_dir"] == str(run_dir)]
    last = step_rows_of(run_dir / "metrics.jsonl")[-1]
    assert run["status"] == "finished" and run["policies"]["main"] == {
        "step": STEPS,
        "reward_mean": last["reward_mean"],
    }

    out = cli("export", str(run_dir), "--format", "csv", "--out", str(run_dir / "m.csv"))
    assert out.returncode == 0, out.stderr
    with open(run_dir / "m.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == list(range(1, STEPS + 1))
    assert float(table[-1]["reward_mean"]) == pytest.approx(last["reward_mean"])
    out = cli(
        "export", str(run_dir), "--format", "csv", "--what", "trajectories", "--out", str(run_dir / "t.csv")
    )
    assert out.returncode == 0, out.stderr
    with open(run_dir / "t.csv") as f:
        trajs = list(csv.DictReader(f))
    assert trajs and len(json.loads(trajs[0]["tokens"])) == len(json.loads(trajs[0]["loss_mask"]))
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow.parquet as pq

        out = cli("export", str(run_dir), "--format", "parquet", "--out", str(run_dir / "m.parquet"))
        assert out.returncode == 0, out.stderr
        assert pq.read_table(run_dir / "m.parquet").column("step").to_pylist() == list(range(1, STEPS + 1))

    if importlib.util.find_spec("matplotlib") is not None:
        png = run_dir / "reward.png"
        out = cli("plot", str(run_dir), "--metric", "reward_mean", "--out", str(png))
        assert out.returncode == 0, out.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        out = cli("plot", str(run_dir), "--metric", "no_such_metric", "--out", str(png))
        assert out.returncode == 2 and "no run has metric 'no_such_metric'" in out.stderr


def test_dash_needs_one_source() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", "dash"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "error: give exactly one of --run-dir or --controller" in out.stderr
    out = cli("dash", "--run-dir", "/nonexistent/run")
    assert out.returncode == 2 and "error: no state.db in /nonexistent/run" in out.stderr

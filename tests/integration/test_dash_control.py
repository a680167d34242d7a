"""The dashboard's control keys against a live `astraflow up` run (real processes, CURVE keys on):
pause and resume admission, drain a worker, stop the run (trainer checkpoints, `up` exits 0); and
peers without an operator key (a worker's key, an observer key, an unknown key) cannot pause or stop."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")
pytest.importorskip("textual_plotext")

from astraflow.errors import AstraflowError  # noqa: E402
from astraflow.transport.control_client import ControlClient, client_for  # noqa: E402
from astraflow.tui.app import Dashboard  # noqa: E402
from astraflow.tui.source import RunDirSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def status(run_dir: Path) -> dict[str, Any]:
    from astraflow.state.status import build_status
    from astraflow.state.views import open_for_reading

    st = open_for_reading(run_dir / "state.db")
    try:
        return build_status(st)
    finally:
        st.close()


def key_client(run_dir: Path, name: str, timeout_s: float = 30.0) -> ControlClient:
    """A client holding member `name`'s key of the run (made by `up`).

    The timeout is generous: a refusal is an answer, and a controller sharing 2 loaded cores with
    its trainer and worker can take seconds to give it."""
    from astraflow.transport.keys import load_keypair, load_public
    from astraflow.transport.security import MemberCredentials

    keys = run_dir / "keys"
    creds = MemberCredentials(
        keypair=load_keypair(keys / "members" / f"{name}.key_secret"),
        controller_public=load_public(str(keys / "controller.key")),
    )
    return ControlClient((run_dir / "controller.addr").read_text().strip(), creds, timeout_s=timeout_s)


def wait(what: str, cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


@pytest.mark.timeout(600)
def test_control_keys_on_a_live_run(tiny_model: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f'extends = "{ROOT / "recipes/quickstart/recipe.toml"}"\n\n[run]\nsteps = 500\n\n'
        f'[[policy]]\nmodel = "{tiny_model}"\nbatch_prompts = 4\n\n[rollout]\nlocal_workers = 1\n'
    )
    run_dir = tmp_path / "run"
    log = (tmp_path / "up.out").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir), "--no-dash"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        wait("the first step", lambda: len(rows(run_dir)) >= 1, 240)
        alive = lambda: {m["id"] for m in status(run_dir)["members"] if m["status"] == "alive"}  # noqa: E731
        wait("the worker", lambda: "raas-0" in alive())

        # peers without an operator key: refused (known keys) or unanswered (unknown key)
        from astraflow.transport.keys import KeyStore, load_keypair, new_key_files
        from astraflow.transport.security import MemberCredentials

        # a worker's key (a second one: a live member's own key would take over its connection)
        new_key_files(run_dir / "keys" / "members", "raas-9")
        pair = load_keypair(run_dir / "keys" / "members" / "raas-9.key_secret")
        KeyStore(run_dir / "keys").add("raas-9", pair.public, "raas")
        for name in ("raas-9", "observer"):
            for call in (lambda c: c.pause(), lambda c: c.stop(), lambda c: c.drain("raas-0")):
                with pytest.raises(AstraflowError, match="not_authorized"):
                    call(key_client(run_dir, name))
        # the operator's name, but a key the run never registered: the CURVE handshake fails, and says so
        new_key_files(tmp_path / "rogue", "operator")
        rogue = key_client(run_dir, "operator", timeout_s=3.0)
        rogue.credentials = MemberCredentials(
            keypair=load_keypair(tmp_path / "rogue" / "operator.key_secret"),
            controller_public=rogue.credentials.controller_public,
        )
        with pytest.raises(AstraflowError, match="does not know key 'operator'"):
            rogue.stop()
        doc = status(run_dir)
        assert doc["control"] == {"paused": []} and up.poll() is None
        assert "raas-0" in alive()

        # the dashboard, with the run's operator key (found in the run directory)
        app = Dashboard(RunDirSource(run_dir), interval_s=30.0, control=client_for(run_dir, None, None, None))

        async def until(pilot: Any, what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
            deadline = time.monotonic() + timeout
            while not cond():
                assert time.monotonic() < deadline, f"timed out waiting for {what}: {app.control_log}"
                await pilot.pause(0.2)

        async def script(pilot: Any) -> None:
            # the shell command pauses one policy; the dashboard shows it and `a` resumes it
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "astraflow",
                    "ctl",
                    "pause",
                    "--run-dir",
                    str(run_dir),
                    "--policy",
                    "main",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0 and "admission paused (main)" in out.stdout, out.stderr
            app.action_refresh_now()
            await until(pilot, "the dashboard to show main paused", lambda: app.snap.paused == ["main"])
            assert "PAUSED" in str(app.progress_text())
            await pilot.press("a")
            await until(pilot, "main resumed", lambda: status(run_dir)["control"]["paused"] == [])
            await pilot.press("A")  # pause the whole run
            await until(pilot, "paused", lambda: status(run_dir)["control"]["paused"] == ["*"])
            await until(pilot, "the dashboard to show it", lambda: app.snap.paused == ["*"])
            queued = status(run_dir)["tasks"]["queued"]
            await pilot.pause(1.0)
            assert status(run_dir)["tasks"]["queued"] == queued  # nothing admitted while paused
            await pilot.press("A")  # resume
            await until(pilot, "resumed", lambda: status(run_dir)["control"]["paused"] == [])
            # drain raas-0: needs the Members tab, the cursor on it, and a yes
            await pilot.press("2")
            await until(pilot, "members", lambda: "raas-0" in [m["id"] for m in app.snap.members])
            from textual.widgets import DataTable

            table = app.query_one("#member-table", DataTable)
            table.move_cursor(row=table.get_row_index("raas-0"))
            await pilot.press("d")
            await pilot.press("n")  # cancelled: nothing happens
            await until(pilot, "cancel", lambda: any("cancelled" in t for t in app.control_log))
            table.move_cursor(row=table.get_row_index("raas-0"))
            await pilot.press("d")
            await pilot.press("y")
            await until(pilot, "raas-0 to leave", lambda: "raas-0" not in alive())
            assert up.poll() is None  # a drained worker leaves; the run goes on
            await pilot.press("S")
            await pilot.press("y")
            await until(
                pilot, "the stop", lambda: any(t.startswith("stop the run: done") for t in app.control_log)
            )

        async def main() -> None:
            async with app.run_test(size=(160, 50)) as pilot:
                await pilot.pause()
                await script(pilot)

        asyncio.run(main())
        assert app.stop_sent
        rc = up.wait(timeout=120)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=60)
        log.close()
    out = (tmp_path / "up.out").read_text(errors="replace")
    assert rc == 0, out[-3000:]
    assert "stopped before its budget" in out
    last = max(r["step"] for r in rows(run_dir))
    assert 1 <= last < 500
    # the trainer checkpointed the last step it finished
    assert (run_dir / "checkpoints" / "main" / f"step-{last}" / "COMPLETE").is_file()

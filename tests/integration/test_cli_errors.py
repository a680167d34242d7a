"""User errors end in one clear message with a hint, a non-zero exit, and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "astraflow", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
    )


def assert_clean_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    # log lines (a member's "joined ...") may come first; the error is one line starting "error: "
    assert "\nerror: " in "\n" + out.stderr, out.stderr
    assert "hint:" in out.stderr
    for n in needles:
        assert n in out.stderr, out.stderr


def test_missing_recipe_file() -> None:
    assert_clean_error(run_cli("recipe", "check", "no/such/recipe.toml"), "recipe not found")


def test_bad_recipe_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nsteps = "many"\n\n[[policy]]\nmodel = "m"\nbogus = 1\n')
    out = run_cli("recipe", "check", str(bad))
    assert_clean_error(out, "run.steps", "policy.0.bogus")


def test_invalid_toml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 3\n")
    assert_clean_error(run_cli("recipe", "check", str(bad)), "not valid TOML")


def test_missing_plugin(tmp_path: Path) -> None:
    bad = tmp_path / "r.toml"
    bad.write_text('[[policy]]\nmodel = "m"\nengine = "warp-drive"\n')
    assert_clean_error(run_cli("recipe", "check", str(bad)), "warp-drive", "torch")


def test_missing_model_directory(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[policy]]\nmodel = "models/definitely-not-here"\n')
    out = run_cli("up", str(recipe), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_clean_error(out, "definitely-not-here", "astraflow model init")


def test_unreachable_controller() -> None:
    out = run_cli("join", "--role", "raas", "--controller", "tcp://127.0.0.1:9", "--connect-timeout", "1.5")
    assert_clean_error(out, "tcp://127.0.0.1:9")


def test_unknown_role() -> None:
    assert_clean_error(run_cli("join", "--role", "pilot", "--controller", "tcp://127.0.0.1:9"), "pilot")


def test_join_without_a_controller() -> None:
    assert_clean_error(run_cli("join", "--role", "raas"), "--controller")


def test_status_of_missing_run_dir(tmp_path: Path) -> None:
    assert_clean_error(run_cli("status", "--run-dir", str(tmp_path)), "state.db")


def test_plugins_json_lists_builtins() -> None:
    import json

    out = run_cli("plugins", "--json")
    assert out.returncode == 0
    doc = json.loads(out.stdout)
    assert "torch" in [p["name"] for p in doc["astraflow.engines"]]
    assert "quickstart" in [p["name"] for p in doc["astraflow.workflows"]]


def test_member_without_the_model_directory(tmp_path: Path) -> None:
    """A controller elsewhere may name a model path this machine lacks: the joining member says so."""
    import os
    import signal
    import time

    port = free_port()
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[policy]]\nmodel = "/nonexistent/tiny-qwen3"\n')
    addr = f"tcp://127.0.0.1:{port}"
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astraflow",
            "controller",
            str(recipe),
            "--run-dir",
            str(tmp_path / "run"),
            "--bind",
            addr,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ},
    )
    try:
        # the controller writes its address once it listens: join after that, not after a guessed time
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "controller.addr").exists():
            assert ctl.poll() is None and time.monotonic() < deadline, "the controller did not start"
            time.sleep(0.05)
        for role in (["--role", "raas"], ["--role", "trainer", "--policy", "main"]):
            out = run_cli("join", *role, "--controller", addr, "--connect-timeout", "20")
            assert_clean_error(out, "/nonexistent/tiny-qwen3", "does not exist on this machine")
    finally:
        ctl.send_signal(signal.SIGTERM)
        ctl.wait(timeout=30)


def test_ctl_without_a_live_run(tmp_path: Path) -> None:
    assert_clean_error(run_cli("ctl", "stop", "--run-dir", str(tmp_path)), "no live controller")


def test_version() -> None:
    from astraflow import __version__

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"astraflow {__version__}"


def test_controller_run_dir_that_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = run_cli("controller", "recipes/quickstart/recipe.toml", "--run-dir", str(blocker / "run"))
    assert_clean_error(out, "cannot write the run directory")


@pytest.mark.parametrize(
    "command",
    [
        ["join", "--role", "raas"],
        ["status"],
        ["ctl", "pause"],
        ["leave", "raas-1"],
        ["dash"],
    ],
)
def test_an_address_without_scheme(command: list[str]) -> None:
    out = run_cli(*command, "--controller", "127.0.0.1:7600")
    assert_clean_error(out, "has no scheme", "tcp://127.0.0.1:7600")


def test_keys_add_refuses_a_key_file_under_another_name(tmp_path: Path) -> None:
    assert run_cli("keys", "init", "--keys", str(tmp_path / "keys")).returncode == 0
    assert run_cli("keys", "new", "observer-ops", "--dir", str(tmp_path)).returncode == 0
    out = run_cli(
        "keys",
        "add",
        "ops",
        str(tmp_path / "observer-ops.key"),
        "--keys",
        str(tmp_path / "keys"),
        "--role",
        "observer",
    )
    assert_clean_error(out, "is the key of 'observer-ops'", "astraflow keys add observer-ops")


@pytest.mark.parametrize("command", ["export", "plot"])
def test_an_output_file_in_a_missing_directory(command: str, tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"policy": "main", "step": 1, "reward_mean": 0.5}\n')
    out = run_cli(command, str(tmp_path), "--out", str(tmp_path / "no" / "such" / "file.csv"))
    assert_clean_error(out, f"no directory {tmp_path / 'no' / 'such'}")


def test_a_damaged_state_db(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "state.db").write_bytes(b"not a database at all" * 10)
    assert_clean_error(run_cli("status", "--run-dir", str(run)), "state.db cannot be read")
    listed = run_cli("runs", str(tmp_path))  # one bad run directory does not hide the others
    assert listed.returncode == 0 and f"{run}  unreadable" in listed.stdout, listed.stderr

"""`astraflow doctor` on this node: ready (exit 0) against a real, authenticated controller; each
broken thing (a secret key others can read, a port taken, a missing model, no controller) a `fail`
finding, and any fail makes the command exit 1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/quickstart/recipe.toml"


def _af(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "astraflow", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_doctor_ready_against_a_live_controller(tiny_model: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert _af("keys", "init", "--keys", str(keys), cwd=tmp_path).returncode == 0
    assert _af("keys", "new", "observer", "--dir", str(tmp_path), cwd=tmp_path).returncode == 0
    add = _af(
        "keys",
        "add",
        "observer",
        str(tmp_path / "observer.key"),
        "--keys",
        str(keys),
        "--role",
        "observer",
        cwd=tmp_path,
    )
    assert add.returncode == 0, add.stderr
    port = free_port()
    run_dir = tmp_path / "run"
    model = f'policy.model="{tiny_model}"'
    ctl = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "controller", str(RECIPE), "--run-dir", str(run_dir),
         "--bind", f"tcp://127.0.0.1:{port}", "--keys", str(keys), "--set", model],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "controller.addr").is_file():
            assert ctl.poll() is None and time.monotonic() < deadline, "the controller did not start"
            time.sleep(0.1)
        common = [
            "--key",
            str(tmp_path / "observer.key_secret"),
            "--controller-key",
            str(keys / "controller.key"),
        ]
        ok = _af(
            "doctor", "--recipe", str(RECIPE), "--set", model, "--controller", f"tcp://127.0.0.1:{port}",
            *common, "--port", str(free_port()), "--run-dir", str(run_dir), "--timeout", "20", "--json",
            cwd=tmp_path,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stdout + ok.stderr
        doc = json.loads(ok.stdout)
        assert doc["ready"] is True
        checks = {f["check"] for f in doc["findings"] if f["level"] == "ok"}
        assert {"python", "torch", "plugin", "model", "key", "port", "controller", "disk", "clock"} <= checks
    finally:
        ctl.terminate()
        ctl.wait(timeout=60)


def test_each_fault_is_a_fail_finding(tmp_path: Path) -> None:
    from astraflow.cluster import doctor as d
    from astraflow.config.load import load_recipe
    from astraflow.transport.keys import new_key_files

    _, secret = new_key_files(tmp_path, "raas-0")
    assert d.check_key(secret, secret=True).level == "ok"
    os.chmod(secret, 0o644)
    found = d.check_key(secret, secret=True)
    assert found.level == "fail" and "mode 644" in found.message
    (tmp_path / "garbage.key_secret").write_text("not a key")
    assert d.check_key(tmp_path / "garbage.key_secret", secret=True).level == "fail"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        assert d.check_port(taken.getsockname()[1]).level == "fail"
    r = load_recipe(RECIPE, ['policy.model="/nonexistent/model"'])
    [model] = d.check_models(r)
    assert model.level == "fail" and "/nonexistent/model does not exist" in model.message
    dead = d.check_controller(f"tcp://127.0.0.1:{free_port()}", None, None, timeout_s=0.5)
    # the probe names the cause when it finds one (nothing listening), else the request timed out
    assert dead.level == "fail" and ("did not answer" in dead.message or "nothing listens" in dead.message)
    assert "math_verify" in d.imported_roots(
        "astraflow.workflows.math.workflow"
    )  # via its process-pool target
    assert d.extra_modules()["math_verify"] == "math"
    r = load_recipe(RECIPE, ['workflow.name="no-such-workflow"'])
    assert [f.level for f in d.check_plugins(r) if "no-such-workflow" in f.message] == ["fail"]


def test_the_command_exits_1_on_a_fail(tmp_path: Path) -> None:
    out = _af(
        "doctor", "--key", str(tmp_path / "missing.key_secret"), "--run-dir", str(tmp_path), cwd=tmp_path
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "fail  key" in out.stdout and "does not exist" in out.stdout

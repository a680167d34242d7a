"""A trainer stops on SIGINT/SIGTERM at a safe point: the signal sets a flag that its long polls and
its retries against a silent controller check, and the process exits with the signal's code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

START = (
    "import json, sys; from pathlib import Path; from astraflow import log; log.setup('controller');"
    "from astraflow.config.recipe import Recipe; from astraflow.roles.controller import run_controller;"
    "sys.exit(run_controller(Recipe.model_validate(json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2])))"
)


def _controller(run_dir: Path, model: Path) -> tuple[subprocess.Popen[bytes], str]:
    # no RaaS joins: a batch is never ready, so the trainer sits in its long poll for batch 1
    recipe = {
        "run": {"name": "stop", "seed": 3, "steps": 3},
        "policy": [{"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1}],
        "workflow": {"name": "quickstart", "options": {"size": 5}},
    }
    (run_dir / "recipe.json").write_text(json.dumps(recipe))
    proc = subprocess.Popen(
        [sys.executable, "-c", START, str(run_dir / "recipe.json"), str(run_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=open(run_dir / "controller.log", "ab"),  # noqa: SIM115 - the child owns it
    )
    addr = run_dir / "controller.addr"
    deadline = time.monotonic() + 120
    while not addr.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (run_dir / "controller.log").read_text()
        time.sleep(0.05)
    return proc, addr.read_text().strip()


def _trainer(run_dir: Path, addr: str, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = run_dir / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "join", "--role", "trainer", "--controller", addr]
        + ["--policy", "main", "--checkpoint-dir", str(run_dir / "ckpt")],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=open(log, "ab"),  # noqa: SIM115 - the child owns it
    )
    return proc, log


def _wait_for_line(proc: subprocess.Popen[bytes], log: Path, text: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"trainer exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in the trainer's log:\n{log.read_text()}"
        time.sleep(0.1)


def test_a_signal_stops_the_trainer_in_its_long_poll_with_or_without_a_controller(
    tiny_model: Path, tmp_path: Path
) -> None:
    ctl, addr = _controller(tmp_path, tiny_model)
    procs = [ctl]
    try:
        # Ctrl-C while the controller holds the batch request: 130, as an interrupted command exits
        first, log = _trainer(tmp_path, addr, "first")
        procs.append(first)
        _wait_for_line(first, log, "training main from step 0 to 3")
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130, log.read_text()

        # SIGTERM while the controller is gone and the trainer waits for a reply that never comes: 143,
        # not after the request's timeout and 600 s of retries (the retries' own check of the stop flag:
        # test_a_stop_ends_the_retries_against_a_silent_controller below)
        second, log = _trainer(tmp_path, addr, "second")
        procs.append(second)
        _wait_for_line(second, log, "training main from step 0 to 3")
        ctl.kill()
        ctl.wait()
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 143, log.read_text()
        assert "stopping on signal; last step 0" in log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class _SilentController:
    """A FAKE member client (no sockets): every request times out, as against a dead controller."""

    def __init__(self) -> None:
        self.asked = 0

    def request(self, msg: object, timeout_s: float, stop: object = None) -> object:
        self.asked += 1
        from astraflow.errors import ConnectError

        raise ConnectError("no answer")

    def check_reachable(self) -> None:
        pass  # nothing listening, but not yet for long: the retries go on

    def tick(self) -> None:
        pass


def test_a_stop_ends_the_retries_against_a_silent_controller() -> None:
    import threading

    import pytest

    from astraflow.errors import Stopped
    from astraflow.protocol.messages import StatusRequest
    from astraflow.roles.member import request_retrying
    from astraflow.roles.stop_flag import StopFlag

    client, stop = _SilentController(), StopFlag()
    # the flag is set while the retries run (after the first attempt), as a signal would set it
    threading.Timer(0.3, stop.set, args=(signal.SIGTERM,)).start()
    with pytest.raises(Stopped):
        request_retrying(client, StatusRequest(), give_up_after_s=600.0, stop=stop)
    assert client.asked >= 1 and stop.exit_code == 143

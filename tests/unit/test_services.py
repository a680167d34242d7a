"""Recipe [[service]] processes under the launcher: ready wait, clear start errors, group stop."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from astraflow.config.service import ServiceConfig
from astraflow.errors import AstraflowError
from astraflow.launch.pool import LocalPool
from astraflow.launch.services import start_services
from astraflow.launch.supervisor import Supervisor
from tests.ports import free_port

# a tiny listener, then a grandchild of its own (as a shell script that starts a server would have)
SERVER = """
import socket, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(0.3)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[2]))); s.listen()
time.sleep(600)
"""


def _no_pool(sup: Supervisor, run_dir: Path) -> LocalPool:
    """The local RaaS pool of a run without local workers or autoscaling."""
    rollout = SimpleNamespace(local_workers=0, autoscale=SimpleNamespace(enabled=False, max=0), gpus="")
    return LocalPool(sup, rollout, run_dir, {}, [])


def _sup(tmp_path: Path) -> Supervisor:
    (tmp_path / "logs").mkdir()
    return Supervisor(tmp_path)


def _server(tmp_path: Path) -> tuple[Path, Path, int]:
    """The SERVER script, the file it writes its child's pid to, and a free port for it."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    return script, tmp_path / "child.pid", free_port()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def test_a_service_that_exits_before_it_is_ready_fails_the_start_with_its_output(tmp_path: Path) -> None:
    sup = _sup(tmp_path)
    cfg = ServiceConfig(
        name="env",
        command=["python", "-c", "import sys; print('no such game file'); sys.exit(3)"],
        ready="127.0.0.1:1",
    )
    with pytest.raises(AstraflowError, match=r"(?s)exited \(code 3\).*no such game file"):
        start_services(sup, [cfg])
    sup.stop_all(grace_s=2)


def test_a_service_that_never_listens_times_out(tmp_path: Path) -> None:
    sup = _sup(tmp_path)
    cfg = ServiceConfig(
        name="env", command=[sys.executable, "-c", "import time; time.sleep(60)"], ready="127.0.0.1:1"
    )
    cfg.ready_timeout_s = 0.5
    with pytest.raises(AstraflowError, match="did not accept connections on 127.0.0.1:1 within 0.5s"):
        start_services(sup, [cfg])
    assert sup.children[0].running  # the ready timeout ended the wait, not the service's exit
    sup.stop_all(grace_s=2)
    assert not sup.children[0].running


def test_a_missing_command_is_a_clear_error(tmp_path: Path) -> None:
    sup = _sup(tmp_path)
    with pytest.raises(AstraflowError, match="cannot start service-env"):
        start_services(sup, [ServiceConfig(name="env", command=["/nonexistent/env-server"])])


def test_services_wait_for_ready_and_stop_with_their_whole_process_group(tmp_path: Path) -> None:
    sup = _sup(tmp_path)
    script, child_pid, port = _server(tmp_path)
    cfg = ServiceConfig(
        name="env", command=["python", str(script), str(child_pid), str(port)], ready=f"127.0.0.1:{port}"
    )
    start_services(sup, [cfg])  # returns once the listener (started after a delay) accepts connections
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    grandchild = int(child_pid.read_text())
    assert _alive(grandchild)
    sup.stop_all(grace_s=5)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the service's own child outlived the run"


def test_a_sigkilled_launcher_takes_the_services_own_children_down(tmp_path: Path) -> None:
    """`kill -9` of the process that started the services (a stand-in for `up`: a real Supervisor in a
    real process): the service and the child it started itself are gone within seconds."""
    import signal
    import subprocess

    script, child_pid, port = _server(tmp_path)
    (tmp_path / "logs").mkdir()
    launcher = f"""
import sys, time
from pathlib import Path
from astraflow.config.service import ServiceConfig
from astraflow.launch.supervisor import Supervisor
from astraflow.launch.services import start_services
sup = Supervisor(Path({str(tmp_path)!r}))
cfg = ServiceConfig(name="env", command=["python", {str(script)!r}, {str(child_pid)!r}, "{port}"],
                    ready="127.0.0.1:{port}")
start_services(sup, [cfg])
Path({str(tmp_path / "service.pid")!r}).write_text(str(sup.children[0].proc.pid))
time.sleep(600)
"""
    up = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "service.pid").is_file():
            assert up.poll() is None and time.monotonic() < deadline, "the stand-in launcher did not start"
            time.sleep(0.05)
        service, grandchild = int((tmp_path / "service.pid").read_text()), int(child_pid.read_text())
        assert _alive(service) and _alive(grandchild)
        up.send_signal(signal.SIGKILL)
        up.wait()
        deadline = time.monotonic() + 15
        while (_alive(grandchild) or _alive(service)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the service's own child outlived a SIGKILLed launcher"
        assert not _alive(service)
    finally:
        if up.poll() is None:
            up.kill()
        for f in ("child.pid",):
            if (tmp_path / f).is_file() and _alive(int((tmp_path / f).read_text())):
                os.kill(int((tmp_path / f).read_text()), 9)


def test_recipe_service_tables_are_checked() -> None:
    from pydantic import ValidationError

    from astraflow.config.recipe import Recipe

    base = {"policy": [{"name": "main", "model": "m"}]}
    svc = {"name": "env", "command": ["python", "-m", "x"]}
    assert Recipe(**base, service=[svc]).service[0].ready == ""
    with pytest.raises(ValidationError, match="service names must be unique"):
        Recipe(**base, service=[svc, svc])
    with pytest.raises(ValidationError):
        Recipe(**base, service=[{**svc, "ready": "http://127.0.0.1:8700"}])  # host:port, not a URL
    with pytest.raises(ValidationError):
        Recipe(**base, service=[{**svc, "command": []}])


def test_a_service_that_stops_during_the_run_ends_the_run(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from astraflow.launch.up import _watch

    sup = _sup(tmp_path)
    # a stand-in trainer (a real process that would run for a minute) and a service that quits cleanly
    sup.start_command("trainer-main", "trainer", [sys.executable, "-c", "import time; time.sleep(60)"], {})
    quits = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    start_services(sup, [ServiceConfig(name="env", command=quits)])
    recipe = SimpleNamespace(trainable=lambda: [SimpleNamespace(name="main")], budget=lambda name: 1)
    try:
        code = _watch(
            sup, _no_pool(sup, tmp_path), recipe, tmp_path, {"signal": 0}, time.monotonic(), max_restarts=0
        )
        assert code == 1
        # the service's end ended the run, not the stand-in trainer's (it still runs)
        assert [c.running for c in sup.children if c.name == "trainer-main"] == [True]
    finally:
        sup.stop_all(grace_s=2)


def test_a_service_with_restarts_left_is_started_again_and_the_run_goes_on(tmp_path: Path) -> None:
    """A service that dies during the run (its first life exits 1, leaving a child of its own) is
    started again after its old process group is killed, and the run ends normally when the
    stand-in trainer does."""
    from types import SimpleNamespace

    from astraflow.launch.up import _watch

    port = free_port()
    lives = tmp_path / "lives"
    flaky = f"""
import socket, subprocess, sys, time
from pathlib import Path
lives = Path({str(lives)!r}); n = len(lives.read_text()) if lives.exists() else 0
lives.write_text("x" * (n + 1))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path({str(tmp_path)!r}, "child-%d" % n).write_text(str(child.pid))
s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen()
time.sleep(1.0 if n == 0 else 600)
sys.exit(1)
"""
    sup = _sup(tmp_path)
    sup.start_command("trainer-main", "trainer", [sys.executable, "-c", "import time; time.sleep(6)"], {})
    cfg = ServiceConfig(
        name="env", command=[sys.executable, "-c", flaky], ready=f"127.0.0.1:{port}", max_restarts=1
    )
    start_services(sup, [cfg])
    recipe = SimpleNamespace(
        trainable=lambda: [SimpleNamespace(name="main")], budget=lambda name: 1, service=[cfg]
    )
    try:
        assert (
            _watch(
                sup,
                _no_pool(sup, tmp_path),
                recipe,
                tmp_path,
                {"signal": 0},
                time.monotonic(),
                max_restarts=0,
            )
            == 0
        )
        assert lives.read_text() == "xx", "the service was not started a second time"
        first_child = int((tmp_path / "child-0").read_text())
        assert not _alive(first_child), "the dead service's own child was left running"
        assert sup.children[-1].running and sup.children[-1].restarts == 1
    finally:
        sup.stop_all(grace_s=2)

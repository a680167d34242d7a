"""docs/operations.md's "A secure cluster" walkthrough, run as written: its shell blocks are extracted
and executed by bash against a real controller process on loopback.

Substituted, and only this: `astraflow` runs as `python -m astraflow` (this checkout's code); HOME is a
temporary directory (so `~/.astraflow` is fresh) and the working directory another; `recipe.toml` is the
quickstart recipe; port 7600 is a free port and `0.0.0.0`/`CTL` are 127.0.0.1. The copies the prose asks
for (public `.key` files to the controller host, `controller.key` to the members) are made by the test,
and the revocation bullet revokes `ops` (the observer whose status it then asks) instead of `raas-gpu1`;
`ctl` runs in the remote form its section's prose gives (`--controller ADDR --key admin.key_secret
--controller-key controller.key` for `--run-dir RUN`), without the optional `[--policy main]`.
`join` lines are not run here (they need a model and a whole run: tests/e2e covers those roles).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from astraflow.bench.wire import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _blocks(section: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = block.replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _substitute(cmd: str, port: int) -> str:
    cmd = re.sub(r"^astraflow ", f"{sys.executable} -m astraflow ", cmd)
    cmd = cmd.replace("recipe.toml", str(ROOT / "recipes" / "quickstart" / "recipe.toml"))
    cmd = (
        cmd.replace(":7600", f":{port}")
        .replace("0.0.0.0", "127.0.0.1")
        .replace("tcp://CTL", "tcp://127.0.0.1")
    )
    return cmd


def _bash(cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_secure_cluster_walkthrough_runs_as_written(tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}
    port = free_port()
    blocks = _blocks(_section("A secure cluster (authentication)"))
    init, new, add, start, members = (_commands(b) for b in blocks)

    for cmd in init + new:
        out = _bash(_substitute(cmd, port), work, env)
        assert out.returncode == 0, (cmd, out.stderr)
    for public in (home / ".astraflow").glob("*.key"):  # "copy the public NAME.key to the controller host"
        shutil.copy(public, work / public.name)
    for cmd in add:
        out = _bash(_substitute(cmd, port), work, env)
        assert out.returncode == 0, (cmd, out.stderr)
    assert {"raas-gpu1", "trainer-main", "ops", "admin"} <= set(out.stdout.split()), out.stdout

    (start_cmd,) = start
    log = (tmp_path / "controller.log").open("wb")
    ctl = subprocess.Popen(
        ["bash", "-c", "exec " + _substitute(start_cmd, port)],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        addr_file = work / "runs" / "prod" / "controller.addr"
        deadline = time.monotonic() + 90
        while not addr_file.is_file():
            assert ctl.poll() is None, (tmp_path / "controller.log").read_text()
            assert time.monotonic() < deadline, "controller did not start"
            time.sleep(0.2)
        shutil.copy(
            work / "runs" / "prod" / "keys" / "controller.key", work / "controller.key"
        )  # "copy to members"
        (status,) = [c for c in members if c.startswith("astraflow status")]
        out = _bash(_substitute(status, port), work, env)
        assert out.returncode == 0 and "main" in out.stdout, out.stderr

        # "Revoking a member": the revoked observer's next status says so, in one line
        revoke = _section("A secure cluster (authentication)")
        (revoke_cmd,) = re.findall(r"`(astraflow keys revoke [^`]+)`", revoke)
        out = _bash(_substitute(revoke_cmd.replace("raas-gpu1", "ops"), port), work, env)
        assert out.returncode == 0, out.stderr
        out = _bash(_substitute(status, port), work, env)
        assert out.returncode != 0 and "it is revoked" in out.stderr and "Traceback" not in out.stderr, (
            out.stderr
        )

        # "Pausing and stopping a run", with the remote form its prose gives for a controller elsewhere
        remote = f"--controller tcp://127.0.0.1:{port} --key ~/.astraflow/admin.key_secret --controller-key controller.key"
        for cmd in _commands(_blocks(_section("Pausing and stopping a run: `astraflow ctl`"))[0]):
            cmd = re.sub(r" \[--policy main\]", "", cmd).replace("--run-dir RUN", remote)
            out = _bash(_substitute(cmd, port), work, env)
            assert out.returncode == 0, (cmd, out.stderr)
        assert ctl.wait(timeout=60) == 0  # the stop ends the run: the controller exits 0
    finally:
        ctl.kill()
        ctl.wait()
        log.close()

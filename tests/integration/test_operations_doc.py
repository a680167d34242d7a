"""docs/operations.md's "A secure cluster" walkthrough, run as written: its shell blocks are extracted
and executed by bash against a real controller process on loopback.

Substituted, and only this: `astraflow` runs as `python -m astraflow` (this checkout's code); HOME is a
temporary directory (so `~/.astraflow` is fresh) and the working directory another; `recipe.toml` is the
quickstart recipe; port 7600 is a free port and `0.0.0.0`/`CTL` are 127.0.0.1. The copies the prose asks
for (public `.key` files to the controller host, `controller.key` to the members) are made by the test,
and the revocation bullet revokes `ops` (the observer whose status it then asks) instead of `raas-gpu1`;
`ctl` runs in the remote form its section's prose gives (`--controller ADDR --key admin.key_secret
--controller-key controller.key` for `--run-dir RUN`), without the optional `[--policy main]`.
Its `join` lines are not run there; the second test runs "The roles by hand" with a whole run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from astraflow.cli.status import read_status
from tests.ports import free_port

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


def _alive(run_dir: Path, member: str) -> bool:
    return any(m["id"] == member and m["status"] == "alive" for m in read_status(run_dir)["members"])


@pytest.mark.timeout(600)  # several real processes on 2 shared cores
def test_secure_cluster_walkthrough_runs_as_written(tiny_model: Path, tmp_path: Path) -> None:
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
    shutil.copytree(tiny_model, work / "models" / "tiny-qwen3")  # the quickstart's model, on every machine
    log = (tmp_path / "controller.log").open("wb")
    ctl = subprocess.Popen(
        ["bash", "-c", "exec " + _substitute(start_cmd, port) + SMALL_RUN],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    joined: list[subprocess.Popen[bytes]] = []
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

        # the members join with their keys (the trainer's copy of the key store: the store itself)
        joins = [
            c.replace("[--keys COPY_OF_KEYS_DIR]", "--keys runs/prod/keys") for c in members if " join " in c
        ]
        assert len(joins) == 2, joins
        outs = [(tmp_path / f"join-{i}.log").open("wb") for i in range(2)]
        raas, trainer = (
            subprocess.Popen(
                ["bash", "-c", "exec " + _substitute(c, port)], cwd=work, env=env, stdout=o, stderr=o
            )
            for c, o in zip(joins, outs, strict=True)
        )
        joined += [raas, trainer]
        run_dir = work / "runs" / "prod"
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file():  # a step trained by the two of them
            assert raas.poll() is None and trainer.poll() is None, (tmp_path / "join-0.log").read_text()[
                -2000:
            ]
            assert time.monotonic() < deadline, "no step trained"
            time.sleep(0.2)

        # "Revoking a member", as written: the running worker stops with the revoked message
        revoke = _section("A secure cluster (authentication)")
        (revoke_cmd,) = re.findall(r"`(astraflow keys revoke [^`]+)`", revoke)
        out = _bash(_substitute(revoke_cmd, port), work, env)
        assert out.returncode == 0, out.stderr
        assert raas.wait(timeout=120) == 2  # a one-line error
        said = (tmp_path / "join-0.log").read_text()
        assert "it is revoked" in said and "Traceback" not in said, said[-2000:]

        # and a revoked observer's next status says so, in one line
        out = _bash(_substitute(revoke_cmd.replace("raas-gpu1", "ops"), port), work, env)
        assert out.returncode == 0, out.stderr
        out = _bash(_substitute(status, port), work, env)
        assert out.returncode != 0 and "it is revoked" in out.stderr and "Traceback" not in out.stderr, (
            out.stderr
        )

        # "Pausing and stopping a run", with the remote form its prose gives for a controller elsewhere
        remote = f"--controller tcp://127.0.0.1:{port} --key ~/.astraflow/admin.key_secret --controller-key controller.key"
        # the stop reaches a trainer that is alive (one that fell silent under load rejoins first)
        while not _alive(run_dir, "trainer-main"):
            assert trainer.poll() is None and time.monotonic() < deadline + 240, "trainer not back"
            time.sleep(0.2)
        for cmd in _commands(_blocks(_section("Pausing and stopping a run: `astraflow ctl`"))[0]):
            cmd = re.sub(r" \[--policy main\]", "", cmd).replace("--run-dir RUN", remote)
            out = _bash(_substitute(cmd, port), work, env)
            assert out.returncode == 0, (cmd, out.stderr)
        assert trainer.wait(timeout=120) == 0, (tmp_path / "join-1.log").read_text()[-2000:]
        assert ctl.wait(timeout=60) == 0  # the stop ends the run: the controller exits 0
    finally:
        for p in [ctl, *joined]:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()


SMALL_RUN = (
    " --set run.steps=1000 --set policy.batch_prompts=2 --set policy.group_size=4 --set rollout.slots=4"
)
"""Appended to the controller's line: small steps, and more of them than the test lets it train (ctl stop
ends the run)."""


@pytest.mark.timeout(600)  # several real processes on 2 shared cores
def test_roles_by_hand_walkthrough_runs_as_written(tiny_model: Path, tmp_path: Path) -> None:
    """ "The roles by hand, on one machine", then pause, resume, drain, a controller restart and stop.

    Substituted: `astraflow` as above; `model init` by a copy of the same tiny model made by the test
    fixture; port 7600 a free port; RUN the block's run directory; the controller's line gets SMALL_RUN;
    the `dash` lines are not run (tests/integration/test_dashboard.py drives the dashboard). The restart is the one "Failures and
    restarts" names: the controller killed, then started again with its own line on the same run dir."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}
    port = free_port()
    run = work / "runs" / "manual"

    def sub(cmd: str) -> str:
        cmd = re.sub(r"^astraflow ", f"{sys.executable} -m astraflow ", cmd).replace(":7600", f":{port}")
        cmd = cmd.replace("--run-dir RUN", "--run-dir runs/manual")
        return cmd.replace(
            "recipes/quickstart/recipe.toml", str(ROOT / "recipes" / "quickstart" / "recipe.toml")
        )

    def ok(cmd: str) -> str:
        out = _bash(sub(cmd), work, env)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (cmd, out.stderr)
        return out.stdout

    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, cmd: str) -> subprocess.Popen[bytes]:
        out = (tmp_path / f"{name}.out").open("ab")
        p = subprocess.Popen(["bash", "-c", "exec " + sub(cmd)], cwd=work, env=env, stdout=out, stderr=out)
        procs[name] = p
        return p

    def steps() -> int:
        p = run / "metrics.jsonl"
        return len(p.read_text().splitlines()) if p.exists() else 0

    def until(ready: Callable[[], bool], what: str, limit_s: float = 240) -> None:
        deadline = time.monotonic() + limit_s
        while not ready():
            dead = {n: p.returncode for n, p in procs.items() if p.poll() not in (None, 0)}
            assert not dead, (what, dead, {n: (tmp_path / f"{n}.out").read_text()[-1500:] for n in dead})
            assert time.monotonic() < deadline, f"no {what} after {limit_s}s"
            time.sleep(0.2)

    init, controller, *joins = _commands(_blocks(_section("The roles by hand, on one machine"))[0])
    assert init.startswith("astraflow model init") and init.endswith("--out models/tiny-qwen3"), init
    shutil.copytree(tiny_model, work / "models" / "tiny-qwen3")
    status_json, status_remote = (c for c in joins if c.startswith("astraflow status"))
    joins = [c for c in joins if c.startswith("astraflow join")]
    assert len(joins) == 3, joins
    try:
        start("controller", controller + SMALL_RUN)
        until(lambda: (run / "controller.addr").is_file(), "controller.addr")
        for i, cmd in enumerate(joins):
            start(f"member-{i}", cmd)
        until(lambda: steps() >= 1, "a trained step")

        members = {m["id"]: m["status"] for m in json.loads(ok(status_json))["members"]}
        assert members == {"raas-1": "alive", "raas-2": "alive", "trainer-main": "alive"}, members
        assert "main" in ok(status_remote)

        pause, resume, stop = (
            re.sub(r" \[--policy main\]", "", c)
            for c in _commands(_blocks(_section("Pausing and stopping a run: `astraflow ctl`"))[0])
        )
        ok(pause)
        ok(resume)
        drain = _commands(_blocks(_section("Taking a worker out: `astraflow ctl drain` and SIGTERM"))[0])[0]
        ok(drain)
        assert procs["member-0"].wait(timeout=120) == 0  # raas-1 drained and left

        # "the controller is killed: restart it on the same --run-dir": the run goes on
        procs["controller"].kill()
        procs["controller"].wait()
        done = steps()
        start("controller", controller + SMALL_RUN)
        until(lambda: steps() > done, "a step after the controller's restart")

        until(lambda: _alive(run, "trainer-main") and _alive(run, "raas-2"), "the members alive for the stop")
        ok(stop)
        for name in ("member-2", "member-1", "controller"):  # trainer, raas-2, then the controller
            assert procs[name].wait(timeout=120) == 0, (tmp_path / f"{name}.out").read_text()[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    # the members' files are in the run directory, none in the working directory or under ~
    assert sorted(p.name for p in (run / "checkpoints" / "main").iterdir() if p.name.startswith("step-"))
    for member in ("raas-1", "raas-2", "trainer-main"):
        assert "joined run quickstart" in (run / "logs" / f"{member}.log").read_text(), member
    assert "controller of run quickstart listening" in (run / "logs" / "controller.log").read_text()
    assert sorted(p.name for p in work.iterdir()) == ["models", "runs"]
    assert not (home / ".astraflow").exists()

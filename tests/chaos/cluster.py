"""The roles of one run started by hand on loopback, as on several machines: a controller, RaaS
workers and a trainer, each a real `astraflow` process with its own log; killed on exit."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/quickstart/recipe.toml"


def ro(run_dir: Path) -> sqlite3.Connection:
    """A read-only connection to a run's state.db."""
    return sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True, timeout=10)


class Cluster:
    """Starts the roles of the quickstart recipe with `overrides`; every process is killed on exit."""

    def __init__(self, tmp_path: Path, model: Path, steps: int, *overrides: str) -> None:
        self.tmp = tmp_path
        self.run_dir = tmp_path / "run"
        self.checkpoints = self.run_dir / "checkpoints" / "main"
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.steps = steps
        self.sets = [
            a for o in (f'policy.model="{model}"', f"run.steps={steps}", *overrides) for a in ("--set", o)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        """`astraflow ARGS` with output to tmp/LOG."""
        p = subprocess.Popen(
            [sys.executable, "-m", "astraflow", *args],
            stdout=(self.tmp / log).open("wb"),
            stderr=subprocess.STDOUT,
            cwd=self.tmp,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.procs.append(p)
        return p

    def controller(self, log: str = "controller.log") -> subprocess.Popen[bytes]:
        return self.start(
            ["controller", str(RECIPE), "--run-dir", str(self.run_dir), "--bind", self.addr, *self.sets], log
        )

    def raas(self, i: int) -> subprocess.Popen[bytes]:
        return self.start(
            ["join", "--role", "raas", "--controller", self.addr, "--member-id", f"raas-{i}"], f"raas-{i}.log"
        )

    def trainer(self, log: str = "trainer.log") -> subprocess.Popen[bytes]:
        args = ["join", "--role", "trainer", "--controller", self.addr, "--policy", "main"]
        return self.start([*args, "--checkpoint-dir", str(self.checkpoints)], log)

    def log(self, name: str, tail: int = 3000) -> str:
        return (self.tmp / name).read_text()[-tail:]

    def steps_done(self) -> int:
        p = self.run_dir / "metrics.jsonl"
        return sum(1 for line in p.read_text().splitlines() if line.strip()) if p.exists() else 0

    def wait_steps(self, n: int, watch: subprocess.Popen[bytes], log: str, timeout: float = 240) -> None:
        """Until metrics.jsonl has n steps; fails with the log if `watch` dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.steps_done() < n:
            assert watch.poll() is None, self.log(log)
            time.sleep(0.05)
        assert self.steps_done() >= n, self.log(log)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

"""A real local Ray cluster for tests: a head node and a worker node on this machine, each a
`ray start --block` process in its own session (so stopping it ends exactly its processes), with a
custom resource standing in for GPUs on the worker node and a temporary directory of its own."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos.cluster import free_port

GPU_RESOURCE = "fake_gpu"
"""The custom resource the worker node declares in place of GPUs."""


def skip_reason() -> str:
    """Why a local Ray cluster cannot start here, or '' when it can."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed: pip install 'astraflow[ray]'"
    return ""


class LocalRay:
    """Head + one worker node; `address` for --address, `env` for processes that use the cluster."""

    def __init__(self, head_cpus: int = 2, worker_cpus: int = 4, worker_gpus: int = 2) -> None:
        # Ray's socket paths must stay short: a directory directly under /tmp
        self.tmp = Path(tempfile.mkdtemp(prefix="afray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head_cpus, self.worker_cpus, self.worker_gpus = head_cpus, worker_cpus, worker_gpus
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            # no token authentication, whatever ~/.ray holds (a local cluster started by ray.init makes one)
            "RAY_AUTH_MODE": "disabled",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""),) if p),
        }
        self.ray = [sys.executable, "-m", "ray.scripts.scripts"]

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.tmp / f"{name}.out", "wb")  # noqa: SIM115 - lives as long as the node
        self.procs.append(
            subprocess.Popen(
                [*self.ray, "start", "--block", "--disable-usage-stats", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        )

    def start(self, timeout_s: float = 120.0) -> None:
        """Start both nodes and wait until the cluster lists them."""
        common = ["--temp-dir", str(self.tmp / "r"), "--node-ip-address", "127.0.0.1"]
        self._start(
            [
                "--head",
                "--port",
                str(self.port),
                "--num-cpus",
                str(self.head_cpus),
                "--include-dashboard",
                "false",
                "--node-manager-port",
                str(free_port()),
                "--object-manager-port",
                str(free_port()),
                *common,
            ],
            "head",
        )
        # the worker node waits for the head's GCS by itself
        self._start(
            [
                "--address",
                self.address,
                "--num-cpus",
                str(self.worker_cpus),
                "--resources",
                json.dumps({GPU_RESOURCE: self.worker_gpus}),
                "--node-manager-port",
                str(free_port()),
                "--object-manager-port",
                str(free_port()),
                *common,
            ],
            "worker",
        )
        self._wait_nodes(2, timeout_s)

    def _wait_nodes(self, n: int, timeout_s: float) -> None:
        probe = (
            "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(sum(1 for x in ray.nodes() if x['Alive']))"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Ray node exited: {self.logs()[-3000:]}")
            out = subprocess.run(
                [sys.executable, "-c", probe, self.address],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=120,
            )
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not list {n} nodes: {out.stderr[-2000:]}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The nodes' own output."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("*.out")))

    def stop(self) -> None:
        """End both nodes: SIGTERM to each node's session, SIGKILL to what is left after 3 s; then
        remove the cluster's directory."""
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

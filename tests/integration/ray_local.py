"""A real local Ray cluster for tests, inside a network namespace of its own: a head node and a worker
node on this machine, each a `ray start --block` process in its own session (so stopping it ends
exactly its processes), with a custom resource standing in for GPUs on the worker node and a
temporary directory of its own.

The namespace (`unshare --net`, holding only a loopback device) is why the cluster stays on loopback:
Ray turns a 127.0.0.1 address into the machine's own address when the machine has one, so on the
host's network its nodes and every role would talk over the machine's interface. Inside the namespace
the only address is 127.0.0.1. Every process that talks to the cluster or to the run's roles runs
there too, through `cmd()` (nsenter into the namespace); the namespace ends with its last process.
"""

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
from typing import Any

from tests.ports import free_port

GPU_RESOURCE = "fake_gpu"
"""The custom resource the worker node declares in place of GPUs."""


def skip_reason() -> str:
    """Why a local Ray cluster cannot start here, or '' when it can."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed: pip install 'astraflow[ray]'"
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")):
        return "needs root with unshare, nsenter and ip: the cluster runs in a network namespace of its own"
    return ""


class LocalRay:
    """Head + one worker node in a fresh network namespace; `address` for --address, `env` and
    `cmd()` for processes that use the cluster."""

    def __init__(self, head_cpus: int = 2, worker_cpus: int = 4, worker_gpus: int = 2) -> None:
        # Ray's socket paths must stay short: a directory directly under /tmp
        self.tmp = Path(tempfile.mkdtemp(prefix="afray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head_cpus, self.worker_cpus, self.worker_gpus = head_cpus, worker_cpus, worker_gpus
        self.procs: list[subprocess.Popen[bytes]] = []
        self.netns: subprocess.Popen[bytes] | None = None
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            # no token authentication, whatever ~/.ray holds (a local cluster started by ray.init makes one)
            "RAY_AUTH_MODE": "disabled",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""),) if p),
        }
        self.ray = [sys.executable, "-m", "ray.scripts.scripts"]

    def enter_netns(self) -> None:
        """Make the namespace: its holder brings loopback up, says so, and lives until its stdin
        closes (stop(), or the end of this process however it ends)."""
        self.netns = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && exec cat >/dev/null"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.netns.stdout is not None
        if self.netns.stdout.readline().strip() != b"up":
            raise RuntimeError(f"cannot make a network namespace (unshare exited {self.netns.wait()})")

    def cmd(self, argv: list[str]) -> list[str]:
        """ARGV run inside the cluster's network namespace."""
        assert self.netns is not None, "start() first"
        return ["nsenter", f"--net=/proc/{self.netns.pid}/ns/net", "--", *argv]

    def run(self, argv: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
        """ARGV to its end inside the namespace, with the cluster's environment; output captured."""
        return subprocess.run(
            self.cmd(argv), capture_output=True, text=True, env=self.env, timeout=timeout, **kw
        )

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.tmp / f"{name}.out", "wb")  # noqa: SIM115 - lives as long as the node
        self.procs.append(
            subprocess.Popen(
                self.cmd([*self.ray, "start", "--block", "--disable-usage-stats", *args]),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        )

    def start(self, timeout_s: float = 180.0) -> None:
        """Make the namespace, start both nodes and wait until the cluster lists them, both on
        127.0.0.1."""
        self.enter_netns()
        common = ["--temp-dir", str(self.tmp / "r"), "--node-ip-address", "127.0.0.1"]
        head = ["--head", "--port", str(self.port), "--num-cpus", str(self.head_cpus)]
        self._start([*head, "--include-dashboard", "false", *self._ports(), *common], "head")
        # the worker node waits for the head's GCS by itself
        resources = json.dumps({GPU_RESOURCE: self.worker_gpus})
        worker = ["--address", self.address, "--num-cpus", str(self.worker_cpus), "--resources", resources]
        self._start([*worker, *self._ports(), *common], "worker")
        nodes = self._wait_nodes(2, timeout_s)
        if set(nodes) != {"127.0.0.1"}:
            raise RuntimeError(f"the Ray nodes are not on loopback: {nodes}")

    @staticmethod
    def _ports() -> list[str]:
        """A node's own raylet and object manager ports."""
        return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port())]

    def _wait_nodes(self, n: int, timeout_s: float) -> list[str]:
        """The addresses of the alive nodes, once there are n."""
        probe = (
            "import json, ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(json.dumps([x['NodeManagerAddress'] for x in ray.nodes() if x['Alive']]))"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Ray node exited: {self.logs()[-3000:]}")
            out = self.run([sys.executable, "-c", probe, self.address])
            lines = out.stdout.strip().splitlines()
            if out.returncode == 0 and lines and len(json.loads(lines[-1])) == n:
                return list(json.loads(lines[-1]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not list {n} nodes: {out.stderr[-2000:]}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The nodes' own output."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("*.out")))

    def stop(self) -> None:
        """End both nodes: SIGTERM to each node's session, SIGKILL to what is left after 3 s; then
        end the namespace's holder and remove the cluster's directory."""
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
        if self.netns is not None:
            assert self.netns.stdin is not None
            self.netns.stdin.close()
            self.netns.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)

"""A real single-node Slurm cluster on this machine (Debian's slurm-wlm: munged, slurmctld, slurmd),
started in a temporary directory with its own config and ports, for tests that submit real jobs.

Needs root (slurmd launches the job's steps) and `apt-get install slurm-wlm munge`; `skip_reason()`
says why it cannot start otherwise. Start-up takes well under a second once installed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.ports import free_port

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


def skip_reason() -> str:
    """Why a local cluster cannot start here, or '' when it can."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "munge") if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "a local slurmd must run as root to launch job steps"
    return ""


class LocalSlurm:
    """slurmctld + slurmd (and munged if none runs) for one node; `env` points clients at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.pids: list[Path] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> None:
        """Write the config, start the daemons and wait until the node is idle."""
        for d in ("spool", "state", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=astraflowtest",
                    f"SlurmctldHost={host}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "ReturnToService=2",
                    "KillWait=3",
                    f"SlurmdSpoolDir={r}/spool",
                    f"StateSaveLocation={r}/state",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.log",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    f"NodeName={host} CPUs={os.cpu_count() or 1} State=UNKNOWN",
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
                ]
            )
            + "\n"
        )
        if not _munge_answers():
            # a socket file left by a munged that is gone (killed, or stopped without cleaning up)
            # refuses connections: --force lets a new munged take its place
            MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
            shutil.chown(MUNGE_SOCKET.parent, "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True)
            self.pids.append(MUNGE_SOCKET.parent / "munged.pid")
            deadline = time.monotonic() + 10
            while not _munge_answers():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"munged started but {MUNGE_SOCKET} does not answer")
                time.sleep(0.1)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon], check=True, env=self.env)
            self.pids.append(r / f"{daemon}.pid")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env)
            if out.stdout.strip() == "idle":
                return
            time.sleep(0.2)
        states = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T %E"], capture_output=True, text=True, env=self.env
        )
        logs = "".join(
            f"--- {f.name}\n" + f.read_text()[-2000:]
            for f in sorted((r / "log").glob("*.log"))
            if f.is_file()
        )
        raise RuntimeError(
            f"the local Slurm node did not become idle: {states.stdout.strip() or states.stderr.strip()}\n{logs}"
        )

    def job_state(self, job: str) -> tuple[str, str]:
        """A job's state and exit code (COMPLETED, 0:0) as scontrol reports them."""
        out = subprocess.run(
            ["scontrol", "show", "job", job], capture_output=True, text=True, env=self.env
        ).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def wait_job(self, job: str, timeout_s: float) -> tuple[str, str]:
        """Wait until a job has ended; returns job_state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "?"):
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {self.job_state(job)} after {timeout_s:.0f}s")

    def report(self, job: str, run_dir: Path, tail: int = 3000) -> str:
        """What a failed job leaves to read: its state, the tail of each of the run's logs (the job
        script's own output among them) and of the daemons' logs (a step Slurm killed says so there)."""
        parts = [f"job {job}: {self.job_state(job)}"]
        logs = sorted((run_dir / "logs").glob("*.log*")) + sorted((run_dir / "logs").glob("*.out"))
        for f in logs + sorted((self.root / "log").glob("*.log")):
            if f.is_file():
                parts.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-tail:])
        # a step that got SIGKILL from outside Slurm (the kernel's OOM killer) shows only here
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()
        kills = [
            line for line in kernel if "killed process" in line.lower() or "out of memory" in line.lower()
        ]
        parts.append("--- kernel log, kills: " + ("\n".join(kills[-10:]) or "none (or dmesg not readable)"))
        return "\n".join(parts)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the daemons this object started (by their pid files) and wait until they are gone."""
        pids = []
        for pid_file in reversed(self.pids):
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for pid in pids:
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _munge_answers() -> bool:
    """Whether a munged answers on its socket (the socket file alone may outlive its daemon)."""
    if not MUNGE_SOCKET.exists():
        return False
    return subprocess.run(["munge", "-n"], capture_output=True).returncode == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

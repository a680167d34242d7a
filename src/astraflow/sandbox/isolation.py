"""How one sandboxed run is started and cleaned up: the command line, the rlimits, and the kill.

Two backends build the command. Both run the program as a dedicated uid (when we are root), with a
cleared environment and the rlimits set by a tiny launcher that then execs the program:
- bwrap: bubblewrap namespaces (no network, own pid/ipc/uts namespace, no further user namespaces),
  read-only binds of what the interpreter needs, a private tmpfs /tmp and the run directory.
- rlimit: the same launcher without namespaces; it shares the host's network and filesystem (the uid's
  permissions are all that keep files out), so it is weaker and documented as such.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from astraflow.sandbox.config import SandboxLimits

SANDBOX_DIR = "/sandbox"
"""Where the run directory appears inside the bubblewrap sandbox."""

# Runs inside the sandbox before the program: lower the limits (soft = hard, so the program cannot
# raise them back) and exec the program, which inherits them.
LAUNCHER = (
    "import os,resource as R,sys\n"
    "c,a,p,f,n=(int(x) for x in sys.argv[1].split(','))\n"
    "for k,v in ((R.RLIMIT_CORE,0),(R.RLIMIT_AS,a),(R.RLIMIT_FSIZE,f),(R.RLIMIT_NOFILE,n),(R.RLIMIT_NPROC,p)):\n"
    "    R.setrlimit(k,(v,v))\n"
    "R.setrlimit(R.RLIMIT_CPU,(c,c+1))\n"
    "os.execv(sys.executable,[sys.executable,'-I','-B']+sys.argv[2:])\n"
)


def resolve_python(configured: str) -> str:
    """The interpreter that runs sandboxed programs: the configured one, /usr/bin/python3, or ours."""
    if configured:
        return configured
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(sys.executable)


@functools.cache
def bwrap_path() -> str | None:
    """The bubblewrap binary, or None when it is not installed."""
    return shutil.which("bwrap")


def limit_args(limits: SandboxLimits, extra_processes: int) -> str:
    """The launcher's limit argument: cpu s, address space B, processes, file size B, open files."""
    return ",".join(
        str(x)
        for x in (
            limits.cpu_s,
            limits.memory_mb << 20,
            limits.processes + extra_processes,
            limits.file_mb << 20,
            limits.open_files,
        )
    )


def _root_binds(python: str) -> list[str]:
    """bwrap arguments exposing, read-only, what the interpreter needs and nothing else of the host."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # The dynamic loader's cache and the alternatives links some distributions point /usr/bin into.
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    args += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
    prefix = Path(os.path.realpath(python)).parent.parent
    if not str(prefix).startswith("/usr"):
        # An interpreter outside /usr (pyenv, conda): its own prefix is needed too, read-only.
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


def bwrap_command(python: str, rundir: Path, limits: SandboxLimits, argv: list[str]) -> list[str]:
    """The bubblewrap command line that runs `argv` (a script path inside the sandbox, then its args)."""
    bwrap = bwrap_path()
    assert bwrap is not None
    env = sandbox_env(SANDBOX_DIR, "/tmp")
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    cmd += ["--new-session", "--hostname", "sandbox"]
    cmd += _root_binds(python)
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    cmd += ["--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
    cmd += ["--bind", str(rundir), SANDBOX_DIR, "--chdir", SANDBOX_DIR, "--clearenv"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    # bwrap's own processes (itself and its pid-1 reaper) run as the run's uid too.
    cmd += ["--", python, "-I", "-B", "-c", LAUNCHER, limit_args(limits, 2), *argv]
    return cmd


def rlimit_command(python: str, limits: SandboxLimits, argv: list[str], extra_processes: int) -> list[str]:
    """The plain-rlimit command line that runs `argv` (a script path, then its args)."""
    return [python, "-I", "-B", "-c", LAUNCHER, limit_args(limits, extra_processes), *argv]


def sandbox_env(home: str, tmp: str) -> dict[str, str]:
    """The whole environment a program sees: nothing of ours (no tokens, no keys), only the basics."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": tmp,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose real uid is `uid`."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        state = uid_line = ""
        for line in status.splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                uid_line = line
                break
        if uid_line and int(uid_line.split()[1]) == uid and state != "Z":
            pids.append(int(entry))
    return pids


def kill_uid(uid: int, rounds: int = 200) -> bool:
    """SIGKILL every process of `uid` until none is left (forks racing the kill are caught next round).

    Only ever called for a dedicated sandbox uid. True when the uid has no live process left.
    """
    for _ in range(rounds):
        pids = processes_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return not processes_of_uid(uid)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (the run's session), ignoring one that is already gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

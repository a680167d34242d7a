"""A pool of sandbox slots: bounded concurrency, an async API, one dedicated uid per slot.

Each slot owns one uid (base_uid + slot) when we run as root, so a run's process limit counts only
its own processes and cleanup can kill every process of that uid, including a daemonized child that
left the process group. Not root: runs use our own uid, cleanup is the process group only.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import pwd
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from astraflow.errors import AstraflowError
from astraflow.sandbox import isolation
from astraflow.sandbox.config import SandboxConfig, SandboxLimits

log = logging.getLogger("astraflow.sandbox")

UID_BLOCK = 1024
"""uids per pool: base_uid + block * UID_BLOCK + slot (concurrency is at most 1024)."""
MAX_BLOCKS = 64
"""Pools at once on one machine."""
LOCK_DIR = Path(tempfile.gettempdir()) / "astraflow-sandbox-uids"
"""Lock files that say which uid blocks live pools hold."""

Status = Literal["ok", "error", "timeout", "killed", "output_limit"]


class SandboxError(AstraflowError):
    """The sandbox cannot start programs (bubblewrap missing or broken, bad interpreter, uid taken)."""


@dataclass
class SandboxResult:
    """What one run produced."""

    status: Status
    """ok: exit 0; error: other exit code; timeout: wall clock hit; killed: a signal (e.g. CPU limit);
    output_limit: stdout or stderr exceeded the cap and the run was killed."""
    returncode: int | None
    """Exit code (negative: killed by that signal)."""
    stdout: bytes
    stderr: bytes
    wall_s: float
    """Seconds from start to the end of cleanup."""
    uid: int
    """The uid the program ran as."""
    backend: str
    """bwrap or rlimit."""


class _Capture:
    """Reads one pipe to EOF, keeping at most `cap` bytes; sets `flood` when more arrive."""

    def __init__(self, stream: asyncio.StreamReader, cap: int, flood: asyncio.Event) -> None:
        self.data = bytearray()
        self.task = asyncio.ensure_future(self._read(stream, cap, flood))

    async def _read(self, stream: asyncio.StreamReader, cap: int, flood: asyncio.Event) -> None:
        while chunk := await stream.read(1 << 16):
            room = cap - len(self.data)
            self.data += chunk[:room]
            if len(chunk) > room:
                flood.set()
                return


class SandboxPool:
    """Runs untrusted programs, at most config.concurrency at once, each in its own slot."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config if config is not None else SandboxConfig()
        self.python = isolation.resolve_python(self.config.python)
        self.as_root = os.geteuid() == 0
        self.backend = self._choose_backend()
        self._free: asyncio.Queue[int] | None = None
        self._root = Path(tempfile.mkdtemp(prefix="astraflow-sandbox-"))
        os.chmod(self._root, 0o711)
        self._block = 0
        self._lock_fd = -1
        self.busy = 0
        """Slots in use now."""
        self.peak_busy = 0
        """Most slots ever in use at once."""
        if self.as_root:
            self._claim_uids()

    def _choose_backend(self) -> str:
        want = self.config.backend
        if want == "rlimit":
            return "rlimit"
        if isolation.bwrap_path() is None:
            if want == "bwrap":
                raise SandboxError(
                    "sandbox backend 'bwrap' asked for but bubblewrap is not installed",
                    hint="apt-get install bubblewrap, or set sandbox.backend = 'rlimit' (weaker)",
                )
            log.warning("bubblewrap not found: sandbox uses the weaker rlimit backend (no network isolation)")
            return "rlimit"
        return "bwrap"

    def slot_uid(self, slot: int) -> int:
        """The uid runs in `slot` use."""
        return self.config.base_uid + self._block * UID_BLOCK + slot if self.as_root else os.getuid()

    def _claim_uids(self) -> None:
        # Several pools on one machine (one per RaaS process) each hold a block of uids, claimed by a
        # lock file held for the pool's life, so no pool ever signals another pool's runs.
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        for block in range(MAX_BLOCKS):
            fd = os.open(LOCK_DIR / f"block-{self.config.base_uid}-{block}", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._block, self._lock_fd = block, fd
            break
        else:
            raise SandboxError(f"all {MAX_BLOCKS} sandbox uid blocks are in use on this machine")
        for slot in range(self.config.concurrency):
            uid = self.slot_uid(slot)
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                # Leftovers of a crashed earlier pool of ours: nothing else may run as these uids.
                isolation.kill_uid(uid)
                continue
            raise SandboxError(
                f"sandbox uid {uid} belongs to account {name!r}",
                hint="set sandbox.base_uid to a range with no accounts",
            )

    def _slots(self) -> asyncio.Queue[int]:
        # Created lazily so the queue binds to the loop that runs the pool.
        if self._free is None:
            self._free = asyncio.Queue()
            for slot in range(self.config.concurrency):
                self._free.put_nowait(slot)
        return self._free

    async def check(self) -> None:
        """Run a trivial program; on failure of bwrap under backend auto fall back to rlimit, else raise."""
        result = await self.run("print('ok')")
        if result.status == "ok" and result.stdout.strip() == b"ok":
            return
        if self.backend == "bwrap" and self.config.backend == "auto":
            log.warning("bubblewrap failed (%s): falling back to the rlimit backend", result.stderr[-300:])
            self.backend = "rlimit"
            result = await self.run("print('ok')")
            if result.status == "ok":
                return
        raise SandboxError(
            f"the sandbox cannot run a trivial program ({result.status}): {result.stderr[-500:]!r}",
            hint=f"check that {self.python} is readable by uid {self.slot_uid(0)}, or set sandbox.python",
        )

    async def run(
        self,
        code: str,
        *,
        stdin: bytes = b"",
        files: dict[str, str | bytes] | None = None,
        args: list[str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run Python `code` (as main.py, beside `files`) with `stdin`; waits for a free slot first."""
        slots = self._slots()
        slot = await slots.get()
        self.busy += 1
        self.peak_busy = max(self.peak_busy, self.busy)
        try:
            return await self._run_in_slot(slot, code, stdin, files or {}, args or [], limits)
        finally:
            self.busy -= 1
            slots.put_nowait(slot)

    def _prepare(self, slot: int, code: str, files: dict[str, str | bytes]) -> Path:
        rundir = Path(tempfile.mkdtemp(prefix=f"run{slot}-", dir=self._root))
        (rundir / "tmp").mkdir()
        for name, content in {**files, "main.py": code}.items():
            path = (rundir / name).resolve()
            if rundir.resolve() not in path.parents:
                raise SandboxError(f"sandbox file name {name!r} leaves the run directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        if self.as_root:
            uid = self.slot_uid(slot)
            for p in [rundir, *rundir.rglob("*")]:
                os.chown(p, uid, uid)
        return rundir

    def _command(self, rundir: Path, limits: SandboxLimits, args: list[str]) -> tuple[list[str], str]:
        if self.backend == "bwrap":
            argv = [f"{isolation.SANDBOX_DIR}/main.py", *args]
            return isolation.bwrap_command(self.python, rundir, limits, argv), "/"
        # Not root: our own processes count against the process limit, so it sits on top of them.
        extra = 1 if self.as_root else len(isolation.processes_of_uid(os.getuid())) + 1
        return isolation.rlimit_command(self.python, limits, [str(rundir / "main.py"), *args], extra), str(
            rundir
        )

    async def _run_in_slot(
        self,
        slot: int,
        code: str,
        stdin: bytes,
        files: dict[str, str | bytes],
        args: list[str],
        limits: SandboxLimits | None,
    ) -> SandboxResult:
        lim = limits if limits is not None else self.config.limits
        loop = asyncio.get_running_loop()
        start = loop.time()
        uid = self.slot_uid(slot)
        rundir = await asyncio.to_thread(self._prepare, slot, code, files)
        cmd, cwd = self._command(rundir, lim, args)
        env = isolation.sandbox_env(str(rundir), str(rundir / "tmp"))
        ids = {"user": uid, "group": uid, "extra_groups": []} if self.as_root else {}
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                **ids,  # type: ignore[arg-type]
            )
        except OSError as e:
            shutil.rmtree(rundir, ignore_errors=True)
            raise SandboxError(f"cannot start the sandbox: {e}") from e
        try:
            status, rc, out, err = await self._supervise(proc, stdin, lim, uid)
        finally:
            await asyncio.to_thread(shutil.rmtree, rundir, True)
            if self.as_root and self.backend == "rlimit":
                await asyncio.to_thread(sweep_shared_tmp, uid)
        return SandboxResult(status, rc, out, err, loop.time() - start, uid, self.backend)

    async def _supervise(
        self, proc: asyncio.subprocess.Process, stdin: bytes, lim: SandboxLimits, uid: int
    ) -> tuple[Status, int | None, bytes, bytes]:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        flood = asyncio.Event()
        out = _Capture(proc.stdout, lim.output_bytes, flood)
        err = _Capture(proc.stderr, lim.output_bytes, flood)
        feeder = asyncio.ensure_future(_feed(proc.stdin, stdin))
        # proc.wait() also waits for the pipes to close, which a daemonized child can hold open for ever;
        # a pidfd says when the program itself exits.
        loop = asyncio.get_running_loop()
        exited = asyncio.Event()
        try:
            pidfd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            # Already exited and reaped by the loop's child watcher.
            pidfd = -1
            exited.set()
        if pidfd >= 0:
            loop.add_reader(pidfd, exited.set)
        if proc.returncode is not None:
            # Reaped before the pidfd opened (the pid may even be reused): it has exited.
            exited.set()
        waits = {asyncio.ensure_future(exited.wait()), asyncio.ensure_future(flood.wait())}
        try:
            await asyncio.wait(waits, timeout=lim.wall_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled (the task's episode was abandoned): the run must not outlive it either.
            isolation.kill_group(proc.pid)
            if self.as_root:
                isolation.kill_uid(uid)
            feeder.cancel()
            out.task.cancel()
            err.task.cancel()
            raise
        finally:
            for w in waits:
                w.cancel()
            if pidfd >= 0:
                loop.remove_reader(pidfd)
                os.close(pidfd)
        timed_out = not exited.is_set() and not flood.is_set()
        # Whatever happened, nothing of the run may outlive it: its session, then (as root) its uid.
        isolation.kill_group(proc.pid)
        if self.as_root:
            await asyncio.to_thread(isolation.kill_uid, uid)
        feeder.cancel()
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout=2.0)
        except TimeoutError:
            # Not root: a grandchild that left the session still holds the pipes; stop reading them.
            proc._transport.close()  # type: ignore[attr-defined]
            rc = await proc.wait()
        _, pending = await asyncio.wait({out.task, err.task}, timeout=1.0)
        for task in pending:
            task.cancel()
        status: Status
        if flood.is_set():
            status = "output_limit"
        elif timed_out:
            status = "timeout"
        elif rc < 0 or (self.backend == "bwrap" and rc > 128):
            # bubblewrap reports a signalled child as 128 + signal.
            status = "killed"
        elif rc != 0:
            status = "error"
        else:
            status = "ok"
        return status, rc, bytes(out.data), bytes(err.data)

    def close(self) -> None:
        """Remove the pool's scratch directory and give its uid block back."""
        shutil.rmtree(self._root, ignore_errors=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
"""World-writable directories a program under plain rlimits can write to by absolute path."""


def sweep_shared_tmp(uid: int) -> int:
    """Remove what a slot's uid left at the top of the shared temp directories; returns how many.

    Only for a slot uid of our own block: nothing else runs under it, so all it owns there is the
    finished program's (bubblewrap gives each call a private /tmp instead)."""
    removed = 0
    for top in SHARED_TMP:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
                removed += 1
            except OSError:
                continue
    return removed

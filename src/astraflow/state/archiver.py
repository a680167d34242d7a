"""A retention pass's reading half in a process of its own (`controller.retention.archiver =
"process"`): the archiver reads the rows that leave from state.db as any reader does, writes their
Parquet file, and hands back what it found (state/archive.py `Found`); the controller then deletes
those rows and records the file in one transaction (`archive.remove`). What stays on the
controller's core is that transaction: reading the rows into Python and writing the file (most of a
pass with `archive`, docs/architecture.md item 16) run in the archiver.

One pass is in flight at a time: a pass that falls due while one runs is skipped (the next one moves
what it would have). The controller takes a finished pass when it next ticks or records a version.
Each row the archiver found must still meet the pass's condition when it is deleted, or the pass is
given up whole (its file removed; the rows stay for the next pass). A kill of the controller between
the file and the transaction leaves a file that no reader opens, as an inline pass's kill does. When
the archiver process dies or cannot start, the controller logs it and runs its passes inline from
then on.

The archiver runs on the CPUs named by the environment variable ASTRAFLOW_ARCHIVER_CPUS (a comma list,
e.g. "2,3"), when set, else where the controller runs: `astraflow bench control` sets it to keep the
archiver off the controller's pinned core.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.state import archive
from astraflow.state.store import Store

_log = log.get("controller")

CPUS_ENV = "ASTRAFLOW_ARCHIVER_CPUS"
"""The archiver's CPUs, a comma list (unset: the controller's)."""

Job = tuple[str, int, int]
"""(policy, step, keep_steps) of a pass with `archive`."""


class Archiver:
    """The controller's side: starts the archiver process on the first pass, sends it a pass at a
    time, and takes back what it found."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._proc: Any = None
        self._conn: Connection | None = None
        self._job: Job | None = None
        """The pass in flight."""
        self.failed = False
        """The process died or could not start: passes run inline."""

    @property
    def busy(self) -> bool:
        """A pass is in flight."""
        return self._job is not None

    def submit(self, policy: str, step: int, keep_steps: int) -> bool:
        """Hand a pass to the archiver; False when it cannot take one (failed: run it inline). A pass
        due while one is in flight is skipped (True: nothing to run inline)."""
        if self.failed:
            return False
        if self._job is not None:
            return True
        try:
            if self._conn is None:
                self._start()
            assert self._conn is not None
            self._conn.send((policy, step, keep_steps))
        except (OSError, EOFError, ValueError) as exc:
            self._fail(f"could not hand it a pass: {exc}")
            return False
        self._job = (policy, step, keep_steps)
        return True

    def collect(self, store: Store, wait_s: float = 0.0) -> archive.Found | None:
        """The pass the archiver finished (within `wait_s`), its rows deleted and its file recorded
        (None: none finished, or it was given up)."""
        conn = self._conn
        if self._job is None or conn is None:
            return None
        try:
            if not conn.poll(wait_s):
                if self._proc is not None and not self._proc.is_alive():
                    self._fail(f"it exited with code {self._proc.exitcode}")
                return None
            kind, got = conn.recv()
        except (OSError, EOFError) as exc:
            self._fail(f"it stopped answering: {exc}")
            return None
        policy, step, _ = self._job
        self._job = None
        if kind == "error":
            _log.warning("retention pass of %s at step %d failed in the archiver: %s", policy, step, got)
            return None
        if got is None:
            return None
        try:
            archive.remove(store, got)
        except archive.Changed as exc:
            _log.warning("%s; its file is removed and the next pass moves them", exc)
            if got.name:
                (self.run_dir / got.name).unlink(missing_ok=True)
            return None
        return got

    def close(self) -> None:
        """End the process; a pass still in flight is given up (`collect` it first to keep it)."""
        conn, proc = self._conn, self._proc
        self._conn = self._proc = self._job = None
        if conn is not None:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
            conn.close()
        if proc is not None:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    @property
    def pid(self) -> int | None:
        """The archiver process's pid (None: not running)."""
        return None if self._proc is None else int(self._proc.pid)

    def _start(self) -> None:
        db = self.run_dir / "state.db"
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=_serve,
            args=(str(db), str(self.run_dir), theirs, os.environ.get(CPUS_ENV, "")),
            daemon=True,
        )
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, mine
        _log.info("archiver process %d started for the retention passes", proc.pid)

    def _fail(self, why: str) -> None:
        _log.warning(
            "the archiver process failed (%s); retention passes run in the controller from now on", why
        )
        self.failed = True
        self._job = None
        conn, proc = self._conn, self._proc
        self._conn = self._proc = None
        if conn is not None:
            conn.close()
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(5.0)


def cpus_of(text: str) -> set[int]:
    """The CPUs of a comma list ("2,3"); ValueError on anything else."""
    out = {int(x) for x in text.split(",") if x.strip()}
    if not out or min(out) < 0:
        raise ValueError(f"{CPUS_ENV} takes a comma list of CPU numbers, not {text!r}")
    return out


def _serve(db: str, run_dir: str, conn: Connection, cpus: str) -> None:
    """The archiver process: find each pass it is sent (state.db opened read-only) and send back what
    it found, or the error."""
    if cpus:
        os.sched_setaffinity(0, cpus_of(cpus))
    store = Store.open_readonly(db)
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                return
            policy, step, keep_steps = job
            try:
                found = archive.find(store, Path(run_dir), policy, step, keep_steps, "archive")
            except Exception as exc:  # noqa: BLE001 - sent to the controller, which logs it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send(("ok", found))
    finally:
        store.close()

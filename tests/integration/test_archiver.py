"""The retention passes' archiver process (state/archiver.py, `controller.retention.archiver =
"process"`): a real controller on a real state.db, driven through its message handlers, hands its
`archive` passes to a real spawned process that writes the Parquet files; the controller only deletes
the rows. Every trajectory ends in exactly one place (state.db or one recorded file), as with inline
passes, and a kill -9 of the archiver leaves the controller running its passes inline, losing and
doubling nothing."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from astraflow.bench import control_inproc as ci
from astraflow.bench.control_recipe import Shape
from astraflow.state import archive

pytest.importorskip("pyarrow")

SHAPE = Shape(group_size=4, batch_prompts=8)
KEEP = 3


def _driver(tmp_path: Path, archiver: str) -> ci._Driver:
    d = ci._Driver(tmp_path, KEEP, SHAPE, archiver)
    ci.join(d)
    return d


def _places(d: ci._Driver, run_dir: Path) -> tuple[list[int], list[int]]:
    """The ids state.db holds, and the ids the recorded archive files hold (each file once)."""
    store = d.ctl.store
    in_db = [int(r[0]) for r in store.query("SELECT id FROM trajectories")]
    in_files = [
        int(r["id"]) for name, _, _ in archive.files(store) for r in archive.read_file(run_dir / name)
    ]
    return in_db, in_files


def _stored(d: ci._Driver) -> int:
    return int(d.ctl.store.scalar("SELECT MAX(id) FROM trajectories"))


def test_the_archiver_process_writes_the_files_and_every_trajectory_stays_in_one_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the controller's own process may not write an archive file: the archiver (another process) must
    def refuse(*_a: object) -> None:
        raise AssertionError("the controller wrote an archive file itself")

    monkeypatch.setattr(archive, "_write", refuse)
    d = _driver(tmp_path, "process")
    rng = random.Random(0)
    try:
        ci.run_steps(d, 1, 11, rng, 3)  # the pass of step 10 is handed over
        assert d.ctl.archiver is not None and d.ctl.archiver.pid not in (None, os.getpid())
        assert d.ctl.archiver.busy
        deadline = time.time() + 60
        while d.ctl.archiver.busy and time.time() < deadline:
            d.ctl.tick()  # a tick takes a finished pass
            time.sleep(0.05)
        assert not d.ctl.archiver.busy and not d.ctl.archiver.failed
        first = archive.files(d.ctl.store)
        assert len(first) == 1
        ci.run_steps(d, 12, 19, rng, 3)  # steps 20 and 30 fall due
    finally:
        d.ctl.close_archiver()
    assert not d.ctl.archiver.failed and d.ctl.archiver.pid is None
    in_db, in_files = _places(d, tmp_path)
    assert len(archive.files(d.ctl.store)) >= 2
    assert sorted(in_db + in_files) == list(range(1, _stored(d) + 1))  # none lost, none twice
    # what left is what the rule lets go: trajectories consumed at least KEEP steps before a pass
    rows = [r for name, _, _ in archive.files(d.ctl.store) for r in archive.read_file(tmp_path / name)]
    assert {r["status"] for r in rows} <= {"consumed", "expired", "dropped"}
    assert max(r["consumed_step"] for r in rows if r["status"] == "consumed") <= 30 - KEEP
    # the kept counts moved with the rows that left
    counts = archive.archived_counts(d.ctl.store, ci.POLICY)
    assert sum(counts.values()) == len(in_files)
    d.ctl.store.close()


@pytest.mark.chaos
def test_a_killed_archiver_leaves_the_passes_to_the_controller_and_loses_nothing(tmp_path: Path) -> None:
    d = _driver(tmp_path, "process")
    rng = random.Random(1)
    try:
        ci.run_steps(d, 1, 10, rng, 3)  # the pass of step 10 is handed over
        archiver = d.ctl.archiver
        assert archiver is not None and archiver.pid is not None and archiver.busy
        os.kill(archiver.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while not archiver.failed and time.time() < deadline:
            d.ctl.tick()
            time.sleep(0.05)
        assert archiver.failed and not archiver.busy
        recorded = len(archive.files(d.ctl.store))
        ci.run_steps(d, 11, 20, rng, 3)  # the passes of steps 20 and 30 run inline
    finally:
        d.ctl.close_archiver()
    assert len(archive.files(d.ctl.store)) >= recorded + 2
    in_db, in_files = _places(d, tmp_path)
    assert sorted(in_db + in_files) == list(range(1, _stored(d) + 1))
    d.ctl.store.close()

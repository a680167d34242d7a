"""Where a joined member keeps its log and checkpoints: the run directory when given, else a fixed place
under ~/.astraflow, never the working directory; a member id cannot name a path outside it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow import log
from astraflow.roles import member_files


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    handlers = list(logging.getLogger("astraflow").handlers)
    yield tmp_path / "home"
    logger = logging.getLogger("astraflow")
    for h in logger.handlers[len(handlers) :]:
        h.close()
    logger.handlers[:] = handlers
    member_files.configure(None, log_file=False)


def test_with_a_run_directory(home: Path, tmp_path: Path) -> None:
    member_files.configure(tmp_path / "run")
    assert member_files.checkpoint_dir("qs", "main") == tmp_path / "run" / "checkpoints" / "main"
    path = member_files.open_log("raas-1", "qs")
    assert path == tmp_path / "run" / "logs" / "raas-1.log"
    log.get("test").warning("into the member log")
    assert "into the member log" in path.read_text()


def test_without_one_under_home_never_the_working_directory(home: Path, tmp_path: Path) -> None:
    member_files.configure(None, log_file=True)
    assert (
        member_files.checkpoint_dir("qs", "main")
        == home / ".astraflow" / "runs" / "qs" / "checkpoints" / "main"
    )
    assert (
        member_files.open_log("../../etc/evil", "qs")
        == home / ".astraflow" / "runs" / "qs" / "logs" / "_.._etc_evil.log"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_no_log_file_when_output_goes_elsewhere(home: Path) -> None:
    member_files.configure(None)  # stderr is captured here, not a terminal
    assert member_files.open_log("raas-1", "qs") is None
    assert not (home / ".astraflow").exists()

"""What a run leaves on disk is its owner's alone, whatever the umask; names cannot become paths
outside the run."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow.config.load import validate_recipe
from astraflow.errors import AstraflowError
from astraflow.rundir import prepare
from astraflow.state.store import Store
from astraflow.transport.keys import KeyStore


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_run_dir_keys_and_state_are_private_under_umask_000(tmp_path: Path, open_umask: None) -> None:
    recipe = validate_recipe({"policy": [{"name": "main", "model": "m"}]})
    run = prepare(tmp_path / "runs" / "r1", recipe)
    assert _mode(run) == 0o700
    assert _mode(run / "logs") == 0o700 and _mode(run / "checkpoints") == 0o700
    store = Store.open(run / "state.db")
    try:
        store.add_event("start", "x")  # a write: the WAL file exists too
        for f in run.glob("state.db*"):
            assert _mode(f) == 0o600, f
    finally:
        store.close()
    keys = KeyStore.init(tmp_path / "keys")
    assert _mode(keys.directory) == 0o700
    assert _mode(keys.directory / "controller.key_secret") == 0o600


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "", "x" * 65, "ok\n"])
def test_run_and_policy_names_that_would_be_paths_are_refused(name: str) -> None:
    with pytest.raises(AstraflowError, match="name"):
        validate_recipe({"run": {"name": name}, "policy": [{"name": "main", "model": "m"}]})
    with pytest.raises(AstraflowError, match="name"):
        validate_recipe({"policy": [{"name": name, "model": "m"}]})

"""Fixtures of the integration tests that start something expensive once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.slurm_local import LocalSlurm, skip_reason


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """One local Slurm cluster for every test that submits jobs (a second one started after the first
    stopped did not always bring its node up: one cluster, its jobs numbered across the tests)."""
    if skip_reason():
        pytest.skip(skip_reason())
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()

"""`astraflow bench trl` when TRL cannot be installed: one clear error before any run starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.bench.trl import run_bench
from astraflow.errors import AstraflowError

ROOT = Path(__file__).resolve().parents[2]


def test_uninstallable_trl_is_a_clear_error_before_any_run(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No package index (and a release that does not exist): pip fails at once, offline.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("ASTRAFLOW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench"
    with pytest.raises(AstraflowError) as err:
        run_bench(
            ROOT / "recipes/quickstart/recipe.toml",
            [f'policy.model="{tiny_model}"'],
            out,
            steps=2,
            trl_version="0.0.0",
            trl_path=None,
            trl_threads=1,
            timeout_s=60,
        )
    assert "could not resolve trl==0.0.0" in str(err.value)
    assert "--trl-path" in (err.value.hint or "")
    assert not (out / "astraflow").exists()  # the astraflow side never started
    assert not (tmp_path / "cache" / "trl-0.0.0" / ".complete").exists()

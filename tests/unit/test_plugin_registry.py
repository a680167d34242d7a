"""The plugin registry reads package metadata once, yet sees a distribution installed afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from astraflow import plugins


def test_a_plugin_installed_after_a_first_look_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    before = {ep.name for ep in plugins.group_entries("astraflow.data")}
    assert "late_stage" not in before
    assert plugins.group_entries("astraflow.data") == plugins.group_entries("astraflow.data")
    # what pip leaves in site-packages: a new dist-info directory (which changes the directory's mtime)
    info = tmp_path / "late_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[astraflow.data]\nlate_stage = late_plugin:Stage\n")
    after = {ep.name for ep in plugins.group_entries("astraflow.data")}
    assert after == before | {"late_stage"}
    assert [
        p.target for p in plugins.list_plugins("astraflow.data")["astraflow.data"] if p.name == "late_stage"
    ] == ["late_plugin:Stage"]

"""`astraflow pack`: a bundle holds the recipe's models and a recipe pointing at them, with checksums
that `pack --check` verifies; a changed, missing or added file is reported and fails the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from astraflow.cluster.pack import platform_tags

ROOT = Path(__file__).resolve().parents[2]


def _af(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "astraflow", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_platform_tags_include_older_manylinux() -> None:
    tags = platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux_2_29_x86_64" not in tags
    assert platform_tags("macosx_14_0_arm64") == ["macosx_14_0_arm64"]


def test_pack_without_wheels_then_check_finds_damage(tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    bundle = tmp_path / "bundle"
    out = _af(
        "pack", str(ROOT / "recipes/quickstart/recipe.toml"), "--out", str(bundle), "--no-wheels",
        "--set", 'policy.model="models/tiny"', cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    recipe = json.loads((bundle / "recipe.json").read_text())
    assert recipe["policy"][0]["model"] == "models/tiny"
    assert (bundle / "models/tiny/model.safetensors").read_bytes() == b"\0" * 4096
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "recipe.json",
        "models/tiny/config.json",
        "models/tiny/model.safetensors",
    }
    sums = (bundle / "SHA256SUMS").read_text()
    assert sums.count("\n") == 3 and "  models/tiny/model.safetensors" in sums
    ok = _af("pack", "--check", str(bundle), cwd=tmp_path)
    assert ok.returncode == 0 and "intact" in ok.stdout, ok.stdout + ok.stderr
    (bundle / "models/tiny/model.safetensors").write_bytes(b"\1" * 4096)  # same size, other bytes
    (bundle / "models/tiny/config.json").unlink()
    (bundle / "stray.txt").write_text("x")
    bad = _af("pack", "--check", str(bundle), cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "changed  models/tiny/model.safetensors" in bad.stdout
    assert "missing  models/tiny/config.json" in bad.stdout
    assert "unlisted stray.txt" in bad.stdout
    again = _af(
        "pack",
        str(ROOT / "recipes/quickstart/recipe.toml"),
        "--out",
        str(bundle),
        "--no-wheels",
        cwd=tmp_path,
    )
    assert again.returncode == 2 and "exists" in again.stderr  # an existing bundle is never overwritten

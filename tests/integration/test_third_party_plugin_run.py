"""A third-party data stage, installed with pip, runs inside a real `astraflow up` without any change
to astraflow: the recipe names it and its counters reach metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.unit.test_third_party_plugin import NAME, installed  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_using_the_plugin_runs_through_up(installed: None, tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    recipe = tmp_path / "with-plugin.toml"
    base = ROOT / "recipes/math-efficient-data/smoke/a-none.toml"
    recipe.write_text(
        f'extends = "{base}"\n\n[[policy]]\nmodel = "{tiny_model}"\n'
        f'data = [{{ name = "{NAME}", options = {{ pattern = "^add-[0-3]$" }} }}]\n'
    )
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir), "--no-dash"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    last = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ][-1]
    assert last[f"data/{NAME}/filtered"] > 0, last
    assert last[f"data/{NAME}/kept"] > 0, last
    assert last["dropped"] > 0

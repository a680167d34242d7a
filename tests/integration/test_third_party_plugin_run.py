"""A third-party data stage, installed with pip, runs inside a real `astraflow up` without any change
to astraflow: the recipe names it and its counters reach metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_third_party_plugin import NAME, installed  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("installed")
def test_recipe_using_the_plugin_runs_through_up(tiny_model: Path, tmp_path: Path) -> None:
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


@pytest.mark.usefixtures("installed")
def test_crashing_workflow_fails_its_tasks_and_the_run_goes_on(tiny_model: Path, tmp_path: Path) -> None:
    """A workflow that raises on some prompts: those tasks are retried up to max_attempts, then marked
    failed with the error kept; every other task is done; no worker dies; the run completes."""
    import sqlite3

    recipe = tmp_path / "flaky.toml"
    base = ROOT / "recipes/math-efficient-data/smoke/a-none.toml"
    recipe.write_text(
        f'extends = "{base}"\n\n[run]\nsteps = 4\n\n[[policy]]\nmodel = "{tiny_model}"\n\n'
        '[workflow]\nname = "flaky"\noptions = { task = "add", length = 1, fail_pattern = "-3$" }\n\n'
        "[rollout]\nmax_attempts = 2\n"
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
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        failed = db.execute(
            "SELECT prompt_key, attempts, error FROM tasks WHERE status = 'failed'"
        ).fetchall()
        assert failed, "the crashing prompt's tasks were never marked failed"
        assert all(k.endswith("-3") and n == 2 and "environment crashed" in e for k, n, e in failed), failed
        done_keys = {k for (k,) in db.execute("SELECT prompt_key FROM tasks WHERE status = 'done'")}
        assert done_keys and not any(k.endswith("-3") for k in done_keys)
        assert {s for (s,) in db.execute("SELECT status FROM members WHERE role = 'raas'")} == {"left"}

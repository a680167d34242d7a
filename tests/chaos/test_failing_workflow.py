"""A workflow that raises on every task, run by `astraflow up`: the traceback reaches the controller
log, a one-line summary reaches the console, the run ends with exit 1 and `status` counts the failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.chaos
def test_failing_workflow_is_visible_and_ends_the_run(tiny_model: Path, tmp_path: Path) -> None:
    # samples without the "answer" the quickstart workflow reads: every episode raises KeyError
    data = tmp_path / "no-answers.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "copy 1 2 ="}) + "\n" for i in range(20)))
    run_dir = tmp_path / "run"
    sets = [
        f'policy.model="{tiny_model}"',
        f'dataset.path="{data}"',
        "run.steps=2",
        "policy.group_size=2",
        "policy.batch_prompts=2",
        "rollout.local_workers=1",
        "rollout.max_attempts=1",
        "rollout.max_failed_tasks=3",
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "up",
            str(ROOT / "recipes/quickstart/recipe.toml"),
            "--run-dir",
            str(run_dir),
            "--offline",
        ]
        + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-3000:]
    assert "[task failed]" in console and "KeyError: 'answer'" in console, console[-3000:]
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "Traceback (most recent call last)" in log and "KeyError: 'answer'" in log
    assert "tasks in a row failed" in log
    status = subprocess.run(
        [sys.executable, "-m", "astraflow", "status", "--run-dir", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(status.stdout)
    assert doc["failures"]["by_reason"]["workflow_error"] >= 3
    assert "KeyError" in doc["failures"]["last_error"]

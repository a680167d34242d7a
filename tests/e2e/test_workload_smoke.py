"""Workload recipes' CPU smoke variants through `astraflow up`, with their real verifiers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init model with a BPE tokenizer (shared by the smoke runs: byte-level covers code too)."""
    return _bpe_model(tmp_path_factory.mktemp("models") / "tiny-bpe", ROOT / "recipes/math/data/corpus.txt")


def _bpe_model(out: Path, corpus: Path) -> Path:
    cmd = [sys.executable, "-m", "astraflow", "model", "init", "--preset", "tiny", "--tokenizer", "bpe"]
    cmd += ["--corpus", str(corpus), "--vocab-size", "320", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    return out


def _up(recipe: Path, run_dir: Path, cwd: Path, *sets: str) -> list[dict[str, float]]:
    cmd = [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir), "--no-dash"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_math_smoke_runs_through_up_with_math_verify(bpe_model: Path, tmp_path: Path) -> None:
    recs = _up(
        ROOT / "recipes/math/smoke.toml",
        tmp_path / "run",
        tmp_path,
        f'policy.model="{bpe_model}"',
        f'dataset.path="{ROOT / "recipes/math/data/arith-smoke.jsonl"}"',
        "run.steps=1",
    )
    assert [r["step"] for r in recs] == [1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in recs)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
def test_code_smoke_runs_through_up_with_the_sandbox(bpe_model: Path, tmp_path: Path) -> None:
    recs = _up(
        ROOT / "recipes/code/smoke.toml",
        tmp_path / "run",
        tmp_path,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
    )
    assert [r["step"] for r in recs] == [1]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
def test_search_smoke_runs_through_up_with_bm25(bpe_model: Path, tmp_path: Path) -> None:
    recs = _up(
        ROOT / "recipes/search/smoke.toml",
        tmp_path / "run",
        ROOT,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
    )
    assert [r["step"] for r in recs] == [1]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
def test_openai_client_agent_trains_through_up(bpe_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    recs = _up(
        ROOT / "recipes/openai_agent/smoke.toml",
        tmp_path / "run",
        ROOT,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
        "policy.batch_prompts=2",  # 4 two-turn episodes: the wiring, at the least CI time
        "policy.group_size=2",
    )
    assert [r["step"] for r in recs] == [1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in recs)
    # both chat turns of each episode extended one trajectory: one Sequence of two policy turns
    assert recs[0]["info/trajectories"] == 1.0 and recs[0]["info/turns"] == 2.0
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
def test_verifiers_environment_trains_through_up(bpe_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("verifiers")
    recs = _up(
        ROOT / "recipes/verifiers/smoke.toml",
        tmp_path / "run",
        ROOT,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
        "policy.batch_prompts=2",  # 4 two-turn episodes: the wiring, at the least CI time
        "policy.group_size=2",
    )
    assert [r["step"] for r in recs] == [1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in recs)
    # the environment's two turns went through the endpoint as one trajectory, scored by its rubric
    assert recs[0]["info/trajectories"] == 1.0 and recs[0]["info/turns"] == 2.0
    assert "info/vf_correct" in recs[0]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()

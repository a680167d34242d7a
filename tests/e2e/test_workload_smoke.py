"""Workload recipes' CPU smoke variants through `astraflow up`, with their real verifiers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.ports import free_port

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


def _up(
    recipe: Path, run_dir: Path, cwd: Path, *sets: str, env: dict[str, str] | None = None
) -> list[dict[str, float]]:
    cmd = [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir), "--no-dash"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _split(recs: list[dict[str, float]]) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(step rows, held-out eval rows) of a metrics.jsonl."""
    return [r for r in recs if r.get("kind") != "eval"], [r for r in recs if r.get("kind") == "eval"]


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
def test_math_smoke_runs_through_up_with_math_verify(bpe_model: Path, tmp_path: Path) -> None:
    recs = _up(
        ROOT / "recipes/math/smoke.toml",
        tmp_path / "run",
        tmp_path,
        f'policy.model="{bpe_model}"',
        f'dataset.path="{ROOT / "recipes/math/data/arith-smoke.jsonl"}"',
        f'eval.path="{ROOT / "recipes/math/data/arith-heldout.jsonl"}"',
        "run.steps=1",
    )
    steps, evals = _split(recs)
    assert [r["step"] for r in steps] == [1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)
    # held-out rounds at version 0 and the last version, every task scored by math-verify
    assert [(r["version"], r["eval/tasks"]) for r in evals] == [(0, 8), (1, 8)]
    assert all(0.0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1.0 for r in evals)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
def test_code_smoke_runs_through_up_with_the_sandbox(bpe_model: Path, tmp_path: Path) -> None:
    # the run's own temporary folder (traversable by the sandbox's uids, like /tmp): the RaaS must
    # remove its sandbox pool's scratch directory as it stops (Workflow.close)
    scratch = Path(tempfile.mkdtemp(prefix="astraflow-test-tmp-"))
    scratch.chmod(0o711)
    try:
        recs = _up(
            ROOT / "recipes/code/smoke.toml",
            tmp_path / "run",
            tmp_path,
            f'policy.model="{bpe_model}"',
            "run.steps=1",
            env={**os.environ, "TMPDIR": str(scratch)},
        )
        # (astraflow-sandbox-uids holds the machine's uid-block locks: it stays)
        left = [p.name for p in scratch.glob("astraflow-sandbox-*") if p.name != "astraflow-sandbox-uids"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert left == [], left
    steps, evals = _split(recs)
    assert [r["step"] for r in steps] == [1]
    # held-out generated functions, tested in the sandbox at version 0 and the last version
    assert [(r["version"], r["eval/tasks"]) for r in evals] == [(0, 4), (1, 4)]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
def test_code_stdio_smoke_runs_programs_on_stdin_in_the_sandbox(bpe_model: Path, tmp_path: Path) -> None:
    recs = _up(
        ROOT / "recipes/code/smoke-stdio.toml",
        tmp_path / "run",
        ROOT,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
        "policy.batch_prompts=2",  # 4 programs: the wiring, at the least CI time
        "policy.group_size=2",
    )
    steps, evals = _split(recs)
    assert [r["step"] for r in steps] == [1]
    assert all(0.0 <= r["info/tests_passed"] <= 1.0 for r in steps)
    # held-out stdin/stdout programs, run in the sandbox at version 0 and the last version
    assert [(r["version"], r["eval/tasks"]) for r in evals] == [(0, 4), (1, 4)]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
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
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
def test_textworld_smoke_generates_games_and_plays_them_through_up(bpe_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("textworld")
    games = tmp_path / "games"
    recs = _up(
        ROOT / "recipes/textworld/smoke.toml",
        tmp_path / "run",
        tmp_path,
        f'policy.model="{bpe_model}"',
        f'workflow.options.games_dir="{games}"',
        "run.steps=1",
    )
    assert [r["step"] for r in recs] == [1]
    # the controller generated the smoke's two games with TextWorld, and episodes were played in them
    assert len(list(games.glob("*.z8"))) == 2
    assert recs[0]["info/turns"] >= 1.0 and 0.0 <= recs[0]["info/score"] <= 1.0
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
@pytest.mark.parametrize("name", ["math-multi-agent", "code-multi-agent"])
def test_multi_agent_smokes_run_through_up(name: str, bpe_model: Path, tmp_path: Path) -> None:
    recs = _up(
        ROOT / f"recipes/{name}/smoke.toml",
        tmp_path / "run",
        ROOT,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
    )
    assert [r["step"] for r in recs] == [1]
    # both roles' sequences reached the one policy's batch, each role reported on its own
    roles = ("solver", "verifier") if name == "math-multi-agent" else ("coder", "tester")
    assert all(f"role/{r}/sequences" in recs[0] for r in roles)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
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
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
@pytest.mark.verifiers
def test_verifiers_environment_trains_through_up(bpe_model: Path, tmp_path: Path) -> None:
    if os.environ.get("ASTRAFLOW_REQUIRE_VERIFIERS"):
        # CI installed verifiers (scripts/ci_verifiers.sh): a broken install must fail, not skip.
        import verifiers  # noqa: F401
    else:
        pytest.importorskip("verifiers", reason="verifiers is not installed (scripts/ci_verifiers.sh)")
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


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses have their own, longer limits
def test_env_server_smoke_starts_the_reference_server_as_a_service(bpe_model: Path, tmp_path: Path) -> None:
    port = free_port()  # the recipe's 8700 may be taken on a shared machine; same command otherwise
    command = ["python", "-m", "astraflow.workflows.env_protocol.reference", "--port", str(port)]
    recs = _up(
        ROOT / "recipes/env_server/smoke.toml",
        tmp_path / "run",
        ROOT,
        f'policy.model="{bpe_model}"',
        "run.steps=1",
        "policy.batch_prompts=2",  # 4 episodes of up to two turns: the wiring, at the least CI time
        "policy.group_size=2",
        f"service.0.command={json.dumps(command)}",
        f'service.0.ready="127.0.0.1:{port}"',
        f'workflow.options.url="http://127.0.0.1:{port}"',
    )
    assert [r["step"] for r in recs] == [1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in recs)
    # every episode was played against the server (reset, its turns, reward) in the separate process
    assert 1.0 <= recs[0]["info/turns"] <= 2.0 and recs[0]["info/env_turns"] == recs[0]["info/turns"]
    log = (tmp_path / "run" / "logs" / "service-env.log").read_text()
    assert f"listening on http://127.0.0.1:{port}" in log
    # `up` stopped the server with the run: nothing listens on its port any more
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert "task_timeout" not in logs and "failed" not in logs.lower()

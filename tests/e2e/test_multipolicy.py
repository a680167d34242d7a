"""Several policies through `astraflow up`: real processes, sockets and tiny models on the CPU.

Asymmetric sizes and budgets both finish and both learn; a frozen policy is served and never trained;
a slowed trainer does not hold the other policy to its pace; a run that cannot move exits 1."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COLLAB = ROOT / "recipes/collab"


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second random init (seed 1): the two policies start from different weights."""
    from astraflow.models.init import init_model

    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("models") / "tiny-qwen3-b", seed=1)


def _up(
    recipe: Path, run_dir: Path, sets: list[str], timeout: float = 400
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir), "--no-dash"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=run_dir.parent)


def _metrics(run_dir: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(rec["policy"], []).append(rec)
    return out


def _rise(rows: list[dict]) -> tuple[float, float]:
    k = max(2, len(rows) // 3)
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    return first, last


@pytest.mark.slow
def test_asymmetric_policies_both_learn_and_a_frozen_one_is_only_served(
    tiny_model: Path, second_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = _up(
        COLLAB / "with-judge.toml",
        run_dir,
        [
            f'policy.0.model="{tiny_model}"',
            f'policy.1.model="{second_model}"',
            f'policy.2.model="{tiny_model}"',
            "policy.0.batch_prompts=2",  # proposer: 2 prompts x group 8 = 16 sequences a step
            "policy.0.steps=20",
            "policy.1.steps=18",  # solver: 8 proposals x group 16 = 128 sequences a step
            "policy.0.optimizer.lr=0.01",
            "policy.1.optimizer.lr=0.01",
        ],
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = _metrics(run_dir)
    assert set(recs) == {"proposer", "solver"}  # the frozen policy never trained
    assert [r["step"] for r in recs["proposer"]] == list(range(1, 21))
    assert [r["step"] for r in recs["solver"]] == list(range(1, 19))
    # each policy's own group size and batch size
    assert {r["role/proposer/sequences"] for r in recs["proposer"]} == {16.0}
    assert {r["role/solver/sequences"] for r in recs["solver"]} == {128.0}
    for pol, rows in recs.items():
        first, last = _rise(rows)
        print(f"{pol}: {len(rows)} steps, reward {first:.3f} -> {last:.3f}")
        # means over a third of the steps (>= 64 sequences each): noise is ~0.01, a rise of 0.05 is learning
        assert last > first + 0.05 and last > 1.5 * first, (pol, [r["reward_mean"] for r in rows])
        assert max(r["staleness_max"] for r in rows) <= (1 if pol == "proposer" else 2)
    # the frozen judge was served (its answers are episode info) and nothing of it was kept or trained
    assert all("info/judge_solved" in r for r in recs["proposer"])
    db = sqlite3.connect(str(run_dir / "state.db"))
    assert db.execute("SELECT COUNT(*) FROM trajectories WHERE policy = 'fixed'").fetchone()[0] == 0
    assert db.execute("SELECT version, step FROM policies WHERE name = 'fixed'").fetchone() == (0, 0)
    assert db.execute("SELECT COUNT(*) FROM batches WHERE policy = 'fixed'").fetchone()[0] == 0
    assert not (run_dir / "logs/trainer-fixed.log").exists()
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "astraflow", "status", "--run-dir", str(run_dir), "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    pols = {p["name"]: p for p in status["policies"]}
    assert pols["fixed"]["trainable"] is False and pols["fixed"]["version"] == 0
    assert pols["proposer"]["finished"] and pols["solver"]["finished"]
    assert pols["proposer"]["budget"] == 20 and pols["solver"]["budget"] == 18
    assert "solver/solved" in pols["solver"]["info"]
    print(f"asymmetric run with a frozen judge: {elapsed:.1f}s")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


@pytest.mark.slow
def test_a_slowed_trainer_does_not_hold_the_other_policy(
    tiny_model: Path, second_model: Path, tmp_path: Path
) -> None:
    """The solver is not held by a slowed proposer: it takes several steps while the proposer takes
    one, at a pace near its pace alone. "Alone" is measured in the same run (same machine load, same
    processes): the solver's steps after the proposer met its budget. Medians of step intervals with a
    wide margin, so load from elsewhere on the machine does not decide it; the 10% bound is a benchmark
    (`astraflow bench pipeline`)."""
    run_dir = tmp_path / "run"
    out = _up(
        COLLAB / "recipe.toml",
        run_dir,
        [
            f'policy.0.model="{tiny_model}"',
            f'policy.1.model="{second_model}"',
            "policy.0.batch_prompts=2",
            # the proposer's trainer sleeps 5 s a step (was 3 s over 2 steps): a longer slowed window,
            # so that a loaded machine's solver still takes several steps inside it
            "policy.0.steps=3",
            "policy.0.trainer_sleep_s=5.0",
            "policy.1.steps=100",  # the rest of the solver's budget is its pace alone
        ],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = _metrics(run_dir)
    t_prop = [r["time"] for r in recs["proposer"]]
    t_solv = [r["time"] for r in recs["solver"]]
    assert len(t_prop) == 3 and len(t_solv) == 100
    # the proposer's trainer sleeps before it publishes: it is slowed until its last step's row
    slowed_until = t_prop[-1]
    gaps = [(b, b - a) for a, b in zip(t_solv[1:], t_solv[2:], strict=False)]  # step 1 is warm-up
    slowed = [g for t, g in gaps if t <= slowed_until]
    alone = [g for t, g in gaps if t > slowed_until + 1.0]  # a second to let the proposer's trainer exit
    # were the solver lock-stepped it would take ~1 step per proposer step (3 in the slowed window);
    # on a fast machine it may take all its steps while the proposer is still slowed
    assert len(slowed) >= 4, (t_prop, t_solv)
    print(
        f"solver: {len(slowed)} step intervals beside the slowed proposer, median {_median(slowed):.2f}s; "
        f"{len(alone)} alone; proposer {len(t_prop)} steps in {t_prop[-1] - t_prop[0]:.1f}s"
    )
    if len(alone) >= 4:
        # lock-step would make the slowed intervals ~5 s (the proposer's sleep) against a fraction of a
        # second alone; the margin is wide so that load from elsewhere on a 2-core machine cannot decide
        # it (the 10% bound is measured by `astraflow bench pipeline`, not asserted here)
        assert _median(slowed) <= 2.0 * _median(alone) + 0.5, (slowed, alone)
    else:
        assert _median(slowed) < 2.5, slowed  # half the proposer's 5 s a step: no lock-step


def test_a_run_that_cannot_move_says_why_and_exits_1(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _up(
        ROOT / "recipes/quickstart/recipe.toml",
        run_dir,
        [
            f'policy.model="{tiny_model}"',
            "rollout.local_workers=0",  # nobody will ever lease the queued tasks
            "controller.stall_warn_s=1.5",
            "controller.stall_fail_s=4",
        ],
        timeout=120,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    log = (run_dir / "logs/controller.log").read_text()
    assert "no progress for" in log and "main: step 0/120" in log and "no alive RaaS serves 'main'" in log
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "astraflow", "status", "--run-dir", str(run_dir), "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert "no alive RaaS serves 'main'" in status["stall"]["waits"]["main"] and status["stall"]["failed"]

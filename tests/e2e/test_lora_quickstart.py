"""LoRA through `astraflow up`: only peft adapters (and the embedding and norms) train, engines get merged
dense weights, and the quickstart policy learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_run_learns_the_quickstart(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "up",
            str(ROOT / "recipes/quickstart/recipe.toml"),
            "--run-dir",
            str(run_dir),
            "--no-dash",
            "--set",
            f'policy.model="{tiny_model}"',
            "--set",
            'policy.trainer_options={lora={rank=16, alpha=32, also_train=["embed_tokens", "norm"]}}',
            "--set",
            "policy.optimizer.lr=5e-3",
            "--set",
            "policy.batch_prompts=16",
            "--set",
            "run.steps=60",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in recs] == list(range(1, 61))
    rewards = [r["reward_mean"] for r in recs]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    print(f"lora quickstart: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.1, rewards
    # The trainer really ran LoRA: its log names the adapters' parameter count.
    log = (run_dir / "logs" / "trainer-main.log").read_text()
    assert "LoRA adapters" in log

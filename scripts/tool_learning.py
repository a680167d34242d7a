"""Learning evidence for a tool-using agent, on a CPU: held-out accuracy before and after RL, per seed.

    python scripts/tool_learning.py [--seeds 0,1,2] [--out runs/tool-learning] [--set a.b=v ...]

1. Warm-start data: 256 solved conversations of the reference server's lookup game with drawn keys and
   values (`env_reference --sft-rows 256 --draw --sft-seed 100`: tool call, tool result, answer).
2. A random-init tiny Qwen3 with a BPE tokenizer trained on that data (`astraflow model init`), then
   `astraflow sft` (10 epochs, lr 3e-3): one warm start shared by every seed.
3. Per seed: `astraflow up recipes/env_server/lookup-draw.toml` from the warm start with run.seed = S:
   RL through the env_server protocol with the lookup tool; the recipe's [eval] scores held-out tasks
   (seed S + 1, never trained on) at version 0 and at the last version.

It prints, per seed, held-out accuracy (pass@1 with reward 1: looked the key up, then answered its
value) and mean reward (avg@4) before and after, the training reward of the first and last 5 steps and
the run's wall time; and writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/env_server/lookup-draw.toml"


def sh(args: list[str], log: Path) -> None:
    """Run one astraflow command; its output goes to `log`; a failure ends the script with its tail."""
    with log.open("wb") as out:
        rc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        sys.exit(f"{' '.join(args[:4])} ... failed (exit {rc}):\n" + "\n".join(tail))


def warm_start(out: Path) -> Path:
    """The shared SFT warm start (built once; reused when OUT already holds it)."""
    py = sys.executable
    model, sft = out / "tiny-draw", out / "tiny-draw-sft"
    if (sft / "config.json").is_file():
        return sft
    data = out / "draw-sft.jsonl"
    with data.open("w") as f:
        subprocess.run(
            [
                py,
                "-m",
                "astraflow.workflows.env_protocol.reference",
                "--sft-rows",
                "256",
                "--draw",
                "--sft-seed",
                "100",
            ],
            stdout=f,
            check=True,
        )
    sh(
        [py, "-m", "astraflow", "model", "init", "--preset", "tiny", "--tokenizer", "bpe", "--corpus",
         str(data), "--vocab-size", "320", "--out", str(model)],
        out / "model-init.log",
    )  # fmt: skip
    t0 = time.monotonic()
    sh(
        [py, "-m", "astraflow", "sft", str(model), str(data), "--out", str(sft), "--epochs", "10",
         "--lr", "3e-3", "--batch-size", "8"],
        out / "sft.log",
    )  # fmt: skip
    print(f"warm start: astraflow sft, 10 epochs, {time.monotonic() - t0:.0f}s", flush=True)
    return sft


def one_seed(seed: int, sft: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    """RL from the warm start with run.seed = seed; the eval rows and training rewards it wrote."""
    run_dir = out / f"seed-{seed}"
    cmd = [sys.executable, "-m", "astraflow", "up", str(RECIPE), "--run-dir", str(run_dir), "--no-dash"]
    for item in [f'policy.model="{sft}"', f"run.seed={seed}", *extra]:
        cmd += ["--set", item]
    t0 = time.monotonic()
    sh(cmd, out / f"seed-{seed}.log")
    wall = time.monotonic() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: int(r["version"]))
    train = [float(r["reward_mean"]) for r in rows if r.get("kind") != "eval" and "reward_mean" in r]
    if len(evals) < 2:
        sys.exit(f"seed {seed}: expected eval rows at the first and last version, got {len(evals)}")
    first, last = evals[0], evals[-1]
    return {
        "seed": seed,
        "versions": [int(first["version"]), int(last["version"])],
        "accuracy": [float(first["eval/pass@1"]), float(last["eval/pass@1"])],
        "reward": [float(first["eval/avg@4"]), float(last["eval/avg@4"])],
        "train_reward": [sum(train[:5]) / max(len(train[:5]), 1), sum(train[-5:]) / max(len(train[-5:]), 1)],
        "wall_s": wall,
    }


def main() -> int:
    """Run the warm start and one RL run per seed; print and write the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, default=Path("runs/tool-learning"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="recipe override a.b=v")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    sft = warm_start(args.out.resolve())
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        print(f"seed {seed}: astraflow up {RECIPE.relative_to(ROOT)} ...", flush=True)
        results.append(one_seed(seed, sft, args.out.resolve(), args.sets))
    print()
    print(f"{'seed':>4}  {'held-out acc':>17}  {'held-out reward':>17}  {'train reward':>15}  {'wall s':>7}")
    for r in results:
        a, w, t = r["accuracy"], r["reward"], r["train_reward"]
        print(
            f"{r['seed']:>4}  {a[0]:>7.3f} -> {a[1]:<6.3f}  {w[0]:>7.3f} -> {w[1]:<6.3f}  "
            f"{t[0]:>5.3f} -> {t[1]:<5.3f}  {r['wall_s']:>7.0f}"
        )
    n = len(results)
    mean = [sum(r["accuracy"][i] for r in results) / n for i in (0, 1)]
    print(f"mean  {mean[0]:>7.3f} -> {mean[1]:<6.3f}  (held-out accuracy, {n} seeds)")
    (args.out / "summary.json").write_text(
        json.dumps({"runs": results, "mean_accuracy": mean}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

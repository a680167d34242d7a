"""An outside package trains a tool-using agent on a CPU: held-out accuracy after SFT and after RL, per seed,
through the OpenAI-compatible endpoint and through the environment-server protocol.

    python scripts/agent_learning.py [--seeds 0,1,2] [--paths endpoint,env] [--out runs/agent-learning]
                                     [--set a.b=v ...]

1. `pip install --target OUT/site examples/calc-agent` (no change to astraflow; OUT/site goes on the
   PYTHONPATH of every command below, as a user's virtualenv would).
2. Warm-start data from the package: 1,024 solved conversations of the calculator game of seed 100
   (`python -m calc_agent.game --teach add,multiply`): system and question, a tool call, its result,
   the result said as the answer. Questions with "plus" and "times" call the right tool; questions
   with "minus" call a tool drawn at random. So the warm start knows the call format, copies results
   and reads the question's word for two operations; that "minus" needs `subtract` is left to RL.
3. A random-init tiny Qwen3 with a BPE tokenizer trained on that data (`astraflow model init`), then
   `astraflow sft` (16 epochs, lr 2e-3): one warm start shared by every run.
4. Per path and seed: `astraflow up examples/calc-agent/recipes/PATH.toml` from the warm start with
   run.seed = S. The recipe's [eval] scores 64 held-out tasks (seed S + 1: questions never trained on)
   4 times each at version 0 (the warm start) and at the last version.

It prints, per run, held-out accuracy (pass@1: the final answer is the right number) before and after,
and of it on the "minus" questions (read from the run's state.db), the share of training episodes
whose first tool was the right one (first and last 5 steps) and the run's wall time; and writes
OUT/summary.json (with the accuracy per operation).
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
PACKAGE = ROOT / "examples/calc-agent"
RIGHT_TOOL = {"endpoint": "info/right_tool", "env": "info/env_right_tool"}
"""Metric of the share of episodes whose first call named the right tool, per path."""


def sh(args: list[str], log: Path, stdout: Path | None = None) -> None:
    """Run one command; its output goes to `log` (its stdout to `stdout` when given); a failure ends the
    script with the log's tail."""
    with log.open("wb") as err:
        if stdout is None:
            rc = subprocess.run(args, stdout=err, stderr=subprocess.STDOUT).returncode
        else:
            with stdout.open("wb") as out:
                rc = subprocess.run(args, stdout=out, stderr=err).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        sys.exit(f"{' '.join(args[:4])} ... failed (exit {rc}):\n" + "\n".join(tail))


def install(out: Path) -> Path:
    """The package installed into OUT/site, which leads PYTHONPATH from here on."""
    site = out / "site"
    sh(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--upgrade", "--target", str(site), str(PACKAGE)],
        out / "install.log",
    )  # fmt: skip
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return site


def warm_start(out: Path) -> Path:
    """The shared SFT warm start (built once; reused when OUT already holds it)."""
    py = sys.executable
    model, sft = out / "tiny-calc", out / "tiny-calc-sft"
    if (sft / "config.json").is_file():
        return sft
    data = out / "calc-sft.jsonl"
    sh(
        [py, "-m", "calc_agent.game", "--sft-rows", "1024", "--seed", "100", "--teach", "add,multiply"],
        out / "sft-data.log",
        stdout=data,
    )
    sh(
        [py, "-m", "astraflow", "model", "init", "--preset", "tiny", "--tokenizer", "bpe", "--corpus",
         str(data), "--vocab-size", "512", "--out", str(model)],
        out / "model-init.log",
    )  # fmt: skip
    t0 = time.monotonic()
    sh(
        [py, "-m", "astraflow", "sft", str(model), str(data), "--out", str(sft), "--epochs", "16",
         "--lr", "2e-3", "--batch-size", "8"],
        out / "sft.log",
    )  # fmt: skip
    print(f"warm start: astraflow sft, 16 epochs, {time.monotonic() - t0:.0f}s", flush=True)
    return sft


def mean(xs: list[float]) -> float:
    """Mean of a list (0 for none)."""
    return sum(xs) / len(xs) if xs else 0.0


def one_run(path: str, seed: int, sft: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    """RL from the warm start through `path` with run.seed = seed; its eval rows and training metrics."""
    run_dir = out / f"{path}-seed-{seed}"
    recipe = PACKAGE / "recipes" / f"{path}.toml"
    cmd = [sys.executable, "-m", "astraflow", "up", str(recipe), "--run-dir", str(run_dir), "--no-dash"]
    for item in [f'policy.model="{sft}"', f"run.seed={seed}", *extra]:
        cmd += ["--set", item]
    t0 = time.monotonic()
    sh(cmd, out / f"{path}-seed-{seed}.log")
    wall = time.monotonic() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: int(r["version"]))
    train = [r for r in rows if r.get("kind") != "eval" and "reward_mean" in r]
    if len(evals) < 2:
        sys.exit(f"{path} seed {seed}: expected eval rows at the first and last version, got {len(evals)}")
    right = [float(r[RIGHT_TOOL[path]]) for r in train if RIGHT_TOOL[path] in r]
    versions = [int(evals[0]["version"]), int(evals[-1]["version"])]
    return {
        "path": path,
        "seed": seed,
        "versions": versions,
        "accuracy": [float(evals[0]["eval/pass@1"]), float(evals[-1]["eval/pass@1"])],
        "accuracy_by_operation": per_operation(run_dir, versions),
        "right_tool": [mean(right[:5]), mean(right[-5:])],
        "train_reward": [mean([float(r["reward_mean"]) for r in train[:5]]),
                         mean([float(r["reward_mean"]) for r in train[-5:]])],
        "wall_s": wall,
    }  # fmt: skip


def per_operation(run_dir: Path, versions: list[int]) -> dict[str, list[float]]:
    """Held-out accuracy per operation of the question at the given versions (the run's eval tasks,
    read from its state.db; the operation from the package's own game)."""
    import sqlite3

    from calc_agent.game import problem

    rewards: dict[tuple[str, int], list[float]] = {}
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT e.version, t.sample, e.rewards FROM eval_tasks e JOIN tasks t ON t.id = e.task_id"
        ).fetchall()
    for version, sample, got in rows:
        rewards.setdefault((problem(json.loads(sample))["op"], int(version)), []).extend(json.loads(got))
    ops = sorted({op for op, _ in rewards})
    return {op: [mean(rewards.get((op, v), [])) for v in versions] for op in ops}


def report(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Print the table; the mean held-out accuracy before and after, per path."""
    print()
    print(
        f"{'path':>8}  {'seed':>4}  {'held-out acc':>17}  {'of it minus':>14}  {'right tool (train)':>18}  "
        f"{'wall s':>7}"
    )
    for r in results:
        a, t = r["accuracy"], r["right_tool"]
        m = r["accuracy_by_operation"].get("subtract", [0.0, 0.0])
        print(
            f"{r['path']:>8}  {r['seed']:>4}  {a[0]:>7.3f} -> {a[1]:<6.3f}  {m[0]:>5.2f} -> {m[1]:<5.2f}  "
            f"{t[0]:>7.2f} -> {t[1]:<7.2f}  {r['wall_s']:>7.0f}"
        )
    means = {}
    for path in dict.fromkeys(r["path"] for r in results):
        runs = [r for r in results if r["path"] == path]
        means[path] = [mean([r["accuracy"][i] for r in runs]) for i in (0, 1)]
        print(f"{path:>8}  mean  {means[path][0]:>7.3f} -> {means[path][1]:<6.3f}  ({len(runs)} seeds)")
    return means


def main() -> int:
    """Install the package, build the warm start, run RL per path and seed; print and write the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--paths", default="endpoint,env", help="endpoint (openai_agent), env (env_server)")
    ap.add_argument("--out", type=Path, default=Path("runs/agent-learning"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="recipe override a.b=v")
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in RIGHT_TOOL for p in paths):
        ap.error(f"--paths takes a comma-separated list of {', '.join(RIGHT_TOOL)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(install(out)))  # this process reads the package's game for the report
    sft = warm_start(out)
    results = []
    for path in paths:
        for seed in (int(s) for s in args.seeds.split(",")):
            print(
                f"{path} seed {seed}: astraflow up {PACKAGE.relative_to(ROOT)}/recipes/{path}.toml",
                flush=True,
            )
            results.append(one_run(path, seed, sft, out, args.sets))
    means = report(results)
    (out / "summary.json").write_text(json.dumps({"runs": results, "mean_accuracy": means}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The data-efficiency benchmark: run recipes that differ in their data stages, then compare them.

Each recipe runs through `astraflow up` as a child process in its own run directory, one after the
other. Afterwards each run is read back from its metrics.jsonl and state.db (read-only): how many
rollouts it generated, trained on (fresh and replayed), filtered and let expire, and its reward curve.

The reward curve is measured on the rollouts, not on the trained batches: a filter such as dynamic
sampling removes all-solved and all-failed groups from the batches, so their mean reward says little
about the policy. Point v of the curve is the mean reward of every trajectory generated with weights
of version v (its oldest token's version), whatever happened to it afterwards. A curator that skips
prompts (GRESO) still biases it, since skipped prompts produce no rollouts at all.

The comparison of the finished runs (the reward target, seed aggregates, ratios to the baseline, the
tables) is bench/data_compare.py.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.state import trajectories
from astraflow.state.batches import replayed_count
from astraflow.state.store import Store

_log = log.get("bench.data")


@dataclass
class RunResult:
    """What one recipe's run produced, read back from its run directory."""

    name: str
    """Variant label: the recipe file's stem."""
    recipe: str
    """Recipe path as given."""
    run_dir: str
    """The run directory `astraflow up` wrote."""
    seed: int | None = None
    """The run.seed it ran with when --seeds was given (None: the recipe's own)."""
    ok: bool = False
    """Whether `astraflow up` exited 0."""
    error: str = ""
    """Why the run failed ('' when it did not)."""
    wall_s: float = 0.0
    """Wall time of the whole `astraflow up`, start-up included."""
    policy: str = ""
    """The policy measured (the recipe's first)."""
    steps: int = 0
    """Optimizer steps the policy took."""
    batch_size: int = 0
    """Sequences per step (batch_prompts * group_size)."""
    generated: int = 0
    """Trajectories produced by the rollout workers."""
    trained_fresh: int = 0
    """Trajectories consumed by a step for the first time."""
    replayed: int = 0
    """Batch slots filled by replaying an already consumed trajectory."""
    filtered: int = 0
    """Trajectories dropped by a post-rollout filter."""
    expired: int = 0
    """Trajectories that went too stale to train on."""
    skipped_prompts: int = 0
    """Prompts a curator declined to submit (no rollouts spent on them)."""
    reward_start: float | None = None
    """Mean rollout reward over the first tenth of versions."""
    reward_final: float | None = None
    """Mean rollout reward over the last tenth of versions (the reward reached)."""
    batch_reward_final: float | None = None
    """Mean reward of the trained batches over the last tenth of steps (biased by filters)."""
    mixed_start: float | None = None
    """Share of groups with unequal rewards (they carry gradient) over the first tenth of versions."""
    mixed_end: float | None = None
    """Share of groups with unequal rewards over the last tenth of versions."""
    curve: list[tuple[int, float, int]] = field(default_factory=list)
    """Per weight version: (version, mean rollout reward, rollouts generated up to that version)."""
    stages: dict[str, float] = field(default_factory=dict)
    """The data stages' counters at the last step (metrics keys starting with data/)."""

    @property
    def trained(self) -> int:
        """Batch slots trained on: fresh plus replayed."""
        return self.trained_fresh + self.replayed


def run_names(paths: list[Path]) -> list[str]:
    """A unique label per recipe: its stem, with -2, -3 ... on repeats."""
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        n = seen.get(p.stem, 0) + 1
        seen[p.stem] = n
        out.append(p.stem if n == 1 else f"{p.stem}-{n}")
    return out


def parse_seeds(text: str) -> list[int]:
    """The seeds of `--seeds 0,1,2`: distinct integers, in the order given."""
    from astraflow.errors import AstraflowError

    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise AstraflowError(f"bad --seeds {text!r}", hint="give distinct integers, e.g. --seeds 0,1,2")
    return seeds


def run_recipe(
    path: Path,
    name: str,
    run_dir: Path,
    overrides: list[str],
    timeout_s: float,
    seed: int | None = None,
) -> RunResult:
    """Run one recipe through `astraflow up` and read its results back; a failure is recorded, not raised."""
    from astraflow.launch.supervisor import astraflow_cmd

    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*astraflow_cmd(), "up", str(path), "--run-dir", str(run_dir), "--no-dash"]
    # The seed goes last so that it wins over a run.seed in the shared overrides.
    for item in [*overrides, *([] if seed is None else [f"run.seed={seed}"])]:
        cmd += ["--set", item]
    res = RunResult(name=name, recipe=str(path), run_dir=str(run_dir), seed=seed)
    log_path = run_dir / "up.log"
    t0 = time.monotonic()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM lets `up` stop its own children in order; SIGKILL only if it does not.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = None
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    res.wall_s = time.monotonic() - t0
    if rc is None:
        res.error = f"timed out after {timeout_s:.0f}s (see {log_path})"
    elif rc != 0:
        res.error = f"exit {rc}: {failure_reason(log_path)} (see {log_path})"
    res.ok = rc == 0
    try:
        read_run(run_dir, res)
    except (OSError, sqlite3.Error, ValueError, KeyError) as exc:
        if res.ok:
            res.ok = False
            res.error = f"could not read the run back: {exc}"
    return res


def failure_reason(log_path: Path) -> str:
    """The most telling line of a failed run's output: its last 'error:' line, else its last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    for ln in reversed(lines):
        if ln.startswith("error:") or " E " in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def read_run(run_dir: Path, res: RunResult) -> RunResult:
    """Fill `res` from the run directory: resolved recipe, metrics.jsonl and state.db (read-only)."""
    resolved = json.loads((run_dir / "recipe.resolved.json").read_text())
    pol = resolved["policy"][0]
    res.policy = str(pol["name"])
    res.batch_size = int(pol["batch_prompts"]) * int(pol["group_size"])
    rows = read_metrics(run_dir / "metrics.jsonl", res.policy)
    res.steps = max((int(r["step"]) for r in rows), default=0)
    if rows:
        last = rows[-1]
        res.stages = {
            k: float(v) for k, v in last.items() if k.startswith("data/") and isinstance(v, int | float)
        }
        res.skipped_prompts = int(res.stages.get("data/prompts_skipped", 0))
        res.batch_reward_final = tail_mean([float(r.get("reward_mean", 0.0)) for r in rows])
    db_path = run_dir / "state.db"
    if not db_path.is_file():
        return res
    store = Store.open_readonly(db_path)
    try:
        counts = trajectories.status_counts(store, res.policy)
        res.generated = sum(int(v) for v in counts.values())
        res.trained_fresh = int(counts.get("consumed", 0))
        res.filtered = int(counts.get("dropped", 0))
        res.expired = int(counts.get("expired", 0))
        res.replayed = replayed_count(store, res.policy)
        res.curve = rollout_curve(store, res.policy)
        mixed = mixed_curve(store, res.policy)
    finally:
        store.close()
    rewards = [r for _, r, _ in res.curve]
    res.reward_start = head_mean(rewards)
    res.reward_final = tail_mean(rewards)
    res.mixed_start = head_mean(mixed)
    res.mixed_end = tail_mean(mixed)
    return res


def read_metrics(path: Path, policy: str) -> list[dict[str, Any]]:
    """The metrics.jsonl rows of one policy, in step order (a torn last line is skipped)."""
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("policy") == policy and "step" in rec and "kind" not in rec:  # not eval or late rows
            rows.append(rec)
    return sorted(rows, key=lambda r: int(r["step"]))


def rollout_curve(store: Store, policy: str) -> list[tuple[int, float, int]]:
    """(version, mean reward, cumulative rollouts) per weight version that generated anything."""
    out = []
    total = 0
    for v, mean, n in trajectories.reward_by_version(store, policy):
        total += n
        if v >= 0:
            out.append((v, mean, total))
    return out


def mixed_curve(store: Store, policy: str, tol: float = 1e-9) -> list[float]:
    """Per weight version (of a group's oldest token), the share of finished groups whose rewards differ."""
    return [m for _, m in trajectories.mixed_by_version(store, policy, tol)]


def head_mean(values: list[float]) -> float | None:
    """Mean of the first tenth (at least one value)."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k


def tail_mean(values: list[float]) -> float | None:
    """Mean of the last tenth (at least one value)."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return sum(values[-k:]) / k

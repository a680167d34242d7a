"""`astraflow bench trl`: the quickstart through `astraflow up` against TRL's GRPOTrainer, in one invocation.

Both sides train the recipe's model from the same random init on the same task: the same prompts
(the workflow's dataset), the same partial-credit reward, group size, prompts per step, new tokens,
temperature, AdamW settings, clip range and steps (TRL: `loss_type="dapo"`, the token mean over
the batch that astraflow's grpo loss takes, `beta=0`, a constant learning rate). What differs is
the system: astraflow's controller, RaaS workers and trainer (one torch thread each, asynchronous
with the recipe's staleness bound) against TRL's single process (generate, score, step, in turn).
With several seeds, one pair runs per seed and each side's steps to the reward target are summarised
over them (mean, range, standard deviation): a single seed's figure moves by several steps either way.

With `heldout` > 0 both sides also save a checkpoint every `checkpoint_every` steps, and afterwards
one evaluator (bench/heldout.py) scores every checkpoint of both (and the starting model) on the same
held-out prompts, greedily: held-out accuracy against the wall-clock seconds from a side's process
start to the end of that step, and how long each side took to reach TRL's final held-out accuracy.
`device` says where TRL and the evaluator run (cpu or cuda); astraflow's roles take the recipe's
devices (auto: the GPU when one is visible).

TRL is not a dependency: it is installed on first use into a cache directory (bench/trl_install.py),
and the TRL side runs in a child process with that directory on its path (bench/trl_side.py). Once
cached, no network. The tables and the statistics over seeds are bench/trl_tables.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from astraflow.bench.trl_install import default_cache, ensure_trl
from astraflow.bench.trl_tables import (
    TARGET,
    WINDOW,
    aggregate,
    format_heldout,
    format_seeds_table,
    format_table,
    steps_ratio,
)
from astraflow.errors import AstraflowError


@dataclass
class Side:
    """One system's run: wall time, first-to-last-step time and its reward curve (one value per step)."""

    name: str
    wall_s: float
    train_s: float
    """From the end of the first step to the end of the last."""
    rewards: list[float] = field(default_factory=list)
    note: str = ""
    cpu_s: float | None = None
    """CPU seconds (user + system) of the side's whole process tree: less sensitive than wall time to
    other work sharing the machine."""
    startup_s: float | None = None
    """From starting the side's process to the end of its first step (start-up and one step)."""
    shutdown_s: float | None = None
    """From the end of the last step to the side's process exit (final checkpoint, teardown)."""
    step_s: list[float] = field(default_factory=list)
    """Seconds from the side's process start to the end of each step (held-out timing)."""

    def summary(self, target: float = TARGET) -> dict[str, Any]:
        """Wall and step times, first and last WINDOW-step reward means, the mean over the last tenth
        of the steps, and the step the WINDOW-step mean first reaches `target`."""
        r = self.rewards
        head = sum(r[:WINDOW]) / len(r[:WINDOW]) if r else None
        tail = sum(r[-WINDOW:]) / len(r[-WINDOW:]) if r else None
        return {
            **asdict(self),
            "steps": len(r),
            "reward_first": head,
            "reward_last": tail,
            "reward_last_tenth": last_tenth(r),
            "target": target,
            "step_reaching": reaching(r, target),
        }


def last_tenth(rewards: list[float]) -> float | None:
    """Mean reward over the last tenth of the steps (at least one step)."""
    if not rewards:
        return None
    tail = rewards[-max(1, len(rewards) // 10) :]
    return sum(tail) / len(tail)


def reaching(rewards: list[float], target: float, window: int = WINDOW) -> int | None:
    """The first step (1-based) whose trailing `window`-step reward mean is >= target."""
    for i in range(window, len(rewards) + 1):
        if sum(rewards[i - window : i]) / window >= target:
            return i
    return None


def spec_of(
    recipe: Any,
    model: str,
    steps: int,
    threads: int,
    output_dir: Path,
    device: str = "cpu",
    save_steps: int = 0,
) -> dict[str, Any]:
    """What the TRL side needs, read from the recipe (its only policy and the quickstart workflow)."""
    if recipe.workflow.name != "quickstart" or len(recipe.policy) != 1:
        raise AstraflowError(
            f"bench trl compares the quickstart task with one policy; this recipe runs "
            f"{recipe.workflow.name!r} with {len(recipe.policy)} policies",
            hint="pass a quickstart recipe, e.g. recipes/quickstart/recipe.toml",
        )
    pol = recipe.policy[0]
    if pol.loss != "grpo" or pol.advantage != "grpo":
        raise AstraflowError(
            f"bench trl maps the grpo loss and advantage onto TRL; this policy uses {pol.loss}/{pol.advantage}",
            hint="set policy.loss and policy.advantage to grpo",
        )
    loss_opts = dict(pol.loss_options)
    clip = float(loss_opts.get("clip_low", 0.2))
    if float(loss_opts.get("clip_high", clip)) != clip or float(loss_opts.get("kl_coef", 0.0)) != 0.0:
        raise AstraflowError(
            "bench trl needs a symmetric clip and no KL term (TRL's epsilon, beta=0)",
            hint="drop clip_high and kl_coef from policy.loss_options",
        )
    opt = pol.optimizer
    return {
        "model": model,
        "workflow_options": dict(recipe.workflow.options),
        "seed": recipe.run.seed,
        "dataset_size": recipe.dataset.size if getattr(recipe, "dataset", None) else 0,
        "group_size": pol.group_size,
        "batch_prompts": pol.batch_prompts,
        "max_new_tokens": pol.sampling.max_new_tokens,
        "temperature": pol.sampling.temperature,
        "lr": opt.lr,
        "betas": list(opt.betas),
        "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip,
        "clip": clip,
        "steps": steps,
        "threads": threads,
        "output_dir": str(output_dir),
        "device": device,
        "save_steps": save_steps,
    }


def children_cpu_s() -> float:
    """User + system seconds of this process's finished (waited-for) descendants so far."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_trl(spec: dict[str, Any], trl_path: Path, out_dir: Path, timeout_s: float) -> Side:
    """Run bench/trl_side.py in a child process with TRL on its path; its measurements as a Side."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file, result_file, log_file = out_dir / "spec.json", out_dir / "result.json", out_dir / "trl.log"
    spec_file.write_text(json.dumps(spec, indent=2))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(trl_path), env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "astraflow.bench.trl_side", str(spec_file), str(result_file)]
    t0, c0, started = time.monotonic(), children_cpu_s(), time.time()
    with log_file.open("wb") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            raise AstraflowError(f"the TRL run took over {timeout_s:.0f}s", hint=f"see {log_file}") from None
    wall, ended = time.monotonic() - t0, time.time()
    if rc != 0 or not result_file.is_file():
        tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise AstraflowError(f"the TRL run failed (exit {rc}): {tail[0]}", hint=f"see {log_file}")
    res = json.loads(result_file.read_text())
    times = res["step_times"]
    note = f"trl {res['trl_version']}, {res['threads']} torch thread(s), one process"
    if res.get("bos_prefixed"):
        note += ", BOS written into the prompt text"
    side = Side("trl", wall, times[-1] - times[0] if len(times) > 1 else 0.0, res["rewards"], note)
    side.cpu_s = children_cpu_s() - c0
    stamps = res.get("step_clock", [])  # wall-clock ends of the steps, comparable with `started`
    if stamps:
        side.startup_s, side.shutdown_s = stamps[0] - started, ended - stamps[-1]
        side.step_s = [t - started for t in stamps]
    return side


def astraflow_side(
    recipe_path: Path, overrides: list[str], run_dir: Path, timeout_s: float, workers: int = 1
) -> Side:
    """Run the recipe through `astraflow up`; wall time, first-to-last-step time and rewards per step."""
    from astraflow.bench.data import read_metrics, run_recipe

    c0, started = children_cpu_s(), time.time()
    res = run_recipe(recipe_path, "astraflow", run_dir, overrides, timeout_s)
    cpu, ended = children_cpu_s() - c0, time.time()
    if not res.ok:
        raise AstraflowError(f"the astraflow run failed: {res.error}", hint=f"see {run_dir / 'up.log'}")
    rows = read_metrics(run_dir / "metrics.jsonl", res.policy)
    times = [float(r["time"]) for r in rows]  # wall clock when the controller recorded each step
    return Side(
        "astraflow",
        res.wall_s,
        times[-1] - times[0] if len(times) > 1 else 0.0,
        [float(r.get("reward_mean", 0.0)) for r in rows],
        f"controller + {workers} RaaS + trainer processes, 1 torch thread each",
        cpu,
        times[0] - started if times else None,
        ended - times[-1] if times else None,
        [t - started for t in times],
    )


def load_average() -> str:
    """The 1/5/15-minute load averages (the machine may be shared)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run_bench(
    recipe_path: Path,
    overrides: list[str],
    out: Path,
    *,
    steps: int | None,
    trl_version: str,
    trl_path: Path | None,
    trl_threads: int,
    timeout_s: float,
    seeds: list[int] | None = None,
    target: float = TARGET,
    say: Any = print,
    device: str = "cpu",
    heldout: int = 0,
    checkpoint_every: int = 10,
) -> dict[str, Any]:
    """The whole bench: check the recipe, get TRL, then per seed run astraflow then TRL; returns the
    summary. Without `seeds` one pair runs with the recipe's run.seed; with several, every pair gets its
    own directory (seed-N/) and the summary adds each side's spread over the seeds."""
    from astraflow.config.load import load_recipe, validate_plugins

    if steps is not None:
        overrides = [*overrides, f"run.steps={steps}"]
    if heldout:
        # every checkpoint stays on disk: the evaluator scores each one afterwards
        overrides = [*overrides, f"policy.checkpoint_every={checkpoint_every}", "policy.keep_checkpoints=0"]
    recipe = load_recipe(recipe_path, overrides)
    validate_plugins(recipe)
    if recipe.dataset.path:
        raise AstraflowError(
            "bench trl builds the TRL dataset from the quickstart workflow's generated prompts",
            hint="leave dataset.path empty",
        )
    pol = recipe.policy[0] if recipe.policy else None
    model = Path(pol.model) if pol is not None else Path()
    if pol is not None and not (model / "config.json").is_file():
        raise AstraflowError(
            f"no model at {pol.model!r}",
            hint=f"create it: astraflow model init --arch qwen3 --preset tiny --out {pol.model}",
        )
    n_steps = int((recipe.budget(pol.name) if pol is not None else 0) or recipe.run.steps)
    spec = spec_of(
        recipe,
        str(model.resolve()),
        n_steps,
        trl_threads,
        out / "trl",
        device=device,
        save_steps=checkpoint_every if heldout else 0,
    )
    if trl_path is not None:
        if not (trl_path / "trl").is_dir():
            raise AstraflowError(
                f"no trl package in {trl_path}", hint="point --trl-path at a pip --target dir"
            )
        path = trl_path
    else:
        path = ensure_trl(trl_version, default_cache())
    out.mkdir(parents=True, exist_ok=True)
    several = seeds is not None and len(seeds) > 1
    runs: list[dict[str, Any]] = []
    for seed in seeds or [recipe.run.seed]:
        where = out / f"seed-{seed}" if several else out
        seeded = [*overrides, f"run.seed={seed}"] if seeds else overrides
        spec = {**spec, "seed": seed, "output_dir": str(where / "trl")}
        before = load_average()
        say(f"astraflow: astraflow up {recipe_path} (seed {seed}, {spec['steps']} steps) ...")
        ours = astraflow_side(
            recipe_path, seeded, where / "astraflow", timeout_s, recipe.rollout.local_workers
        )
        say(f"astraflow: {ours.wall_s:.1f}s wall; trl: GRPOTrainer, same model, task, seed and settings ...")
        theirs = run_trl(spec, path, where / "trl", timeout_s)
        say(f"trl: {theirs.wall_s:.1f}s wall")
        after = load_average()
        run: dict[str, Any] = {"seed": seed, "sides": [ours, theirs], "load": (before, after)}
        if heldout:
            say(f"held-out: every checkpoint of both sides on {heldout} held-out prompts ...")
            run["heldout"] = heldout_curves(recipe, model, where, [ours, theirs], heldout, device)
        runs.append(run)
    first = runs[0]["sides"]
    summary: dict[str, Any] = {
        "recipe": str(recipe_path),
        "overrides": overrides,
        "spec": spec,
        "target": target,
        "cpus": os.cpu_count(),
        "out": str(out),
    }
    if not several:
        ours, theirs = first
        before, after = runs[0]["load"]
        summary.update(
            sides=[x.summary(target) for x in first],
            ratio_wall=ours.wall_s / theirs.wall_s if theirs.wall_s else None,
            ratio_train=ours.train_s / theirs.train_s if theirs.train_s else None,
            ratio_cpu=ours.cpu_s / theirs.cpu_s if ours.cpu_s and theirs.cpu_s else None,
            load_before=before,
            load_after=after,
            table=format_table(first, (before, after), target),
        )
    else:
        per_side = {
            name: [r["sides"][i].summary(target) for r in runs] for i, name in enumerate(("astraflow", "trl"))
        }
        agg = {name: aggregate(items) for name, items in per_side.items()}
        seed_list = [int(r["seed"]) for r in runs]
        summary.update(
            seeds=seed_list,
            runs=[
                {"seed": r["seed"], "sides": [x.summary(target) for x in r["sides"]], "load": list(r["load"])}
                for r in runs
            ],
            aggregate=agg,
            ratio_steps=steps_ratio(agg["astraflow"], agg["trl"]),
            table=format_seeds_table(seed_list, agg, [r["load"] for r in runs], target),
        )
    if heldout:
        summary["heldout"] = [{"seed": r["seed"], **r["heldout"]} for r in runs]
        summary["table"] += "\n\n" + "\n\n".join(
            format_heldout(r["heldout"], f"seed {r['seed']}") for r in runs
        )
    (out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def heldout_curves(
    recipe: Any, model: Path, where: Path, sides: list[Side], n: int, device: str
) -> dict[str, Any]:
    """Held-out accuracy of the starting model and of every checkpoint of both sides, each with the
    seconds from its side's start to the end of its step; and the seconds each side took to reach
    TRL's final held-out accuracy (None if it never did)."""
    from astraflow.bench.heldout import HELDOUT_SEED, Evaluator, checkpoint_dirs, samples

    pol = recipe.policy[0]
    held = samples(dict(recipe.workflow.options), n, HELDOUT_SEED)
    ev = Evaluator(model, held, max_new_tokens=pol.sampling.max_new_tokens, device=device)
    start = ev.accuracy()
    curves: dict[str, list[dict[str, float]]] = {}
    for side in sides:
        run_dir = where / side.name
        points = [{"step": 0, "seconds": 0.0, "accuracy": start}]
        for step, ckpt in checkpoint_dirs(run_dir, side.name):
            if not 1 <= step <= len(side.step_s):
                continue
            ev.load(ckpt)
            points.append({"step": step, "seconds": side.step_s[step - 1], "accuracy": ev.accuracy()})
        curves[side.name] = points
    final = curves["trl"][-1]["accuracy"] if curves.get("trl") else None

    def reach(points: list[dict[str, float]]) -> float | None:
        for p in points:
            if final is not None and p["step"] > 0 and p["accuracy"] >= final:
                return p["seconds"]
        return None

    ours, theirs = reach(curves.get("astraflow", [])), reach(curves.get("trl", []))
    return {
        "prompts": n,
        "start_accuracy": start,
        "curves": curves,
        "trl_final_accuracy": final,
        "seconds_to_trl_final": {"astraflow": ours, "trl": theirs},
        "ratio": ours / theirs if ours is not None and theirs else None,
    }

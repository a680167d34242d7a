"""Held-out evaluation during training: eval rounds queued at version boundaries, an eval ledger, and
the avg@n / pass@k aggregation the controller writes to metrics.jsonl.

An eval round is one (policy, version): every held-out task queued once in the task ledger with a
group of `eval.samples`, read-only for every policy (admission does not count it and its sequences
never become trajectories), and leased only to a worker whose engine already holds that version. So
eval tasks survive a worker's death like any task (lease expiry, requeue), and a restarted controller
reads its open rounds back. A result of an eval task goes to `eval_tasks`, not to a buffer; once no
task of a round is queued or leased, the round is aggregated, marked done and written as one
`kind = "eval"` metrics row. Samples of the held-out set are removed from the training prompts.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.config.eval import EvalConfig
from astraflow.config.recipe import Recipe, WorkflowConfig
from astraflow.dataflow.source import prompt_key, read_jsonl
from astraflow.errors import RecipeError
from astraflow.protocol import packed
from astraflow.protocol.messages import AnyEpisodes, pack_episodes
from astraflow.state import eval_rounds
from astraflow.state.ledger import Ledger, TaskRow
from astraflow.state.store import Store

_log = log.get("eval")

Epochs = Callable[[int], Iterator[dict[str, Any]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (k capped at n)."""
    if n <= 0:
        return 0.0
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def identity(sample: dict[str, Any]) -> str:
    """A sample's content without its key/id: the same problem under another id is the same problem."""
    body = {k: v for k, v in sample.items() if k not in ("key", "id")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class EvalSections:
    """The recipe's sections evaluation uses, and nothing else of it."""

    eval: EvalConfig
    """What is evaluated, how often and how (`[eval]`)."""
    workflow: WorkflowConfig
    """The workflow whose dataset() builds the held-out set when eval.path is empty (`[workflow]`)."""
    seed: int
    """The run's seed: the held-out set is drawn with run.seed + 1 when eval.seed is unset."""
    trainable: list[str]
    """The policies that have a trainer, in recipe order (evaluated when eval.policies is empty)."""
    budgets: dict[str, int]
    """Policy name -> step budget (0 for a frozen policy): the round at the last step."""

    @classmethod
    def of(cls, recipe: Recipe) -> EvalSections:
        """The sections of a validated recipe that has an `[eval]` table."""
        if recipe.eval is None:
            raise ValueError("the recipe has no [eval] table")
        return cls(
            eval=recipe.eval,
            workflow=recipe.workflow,
            seed=recipe.run.seed,
            trainable=[p.name for p in recipe.trainable()],
            budgets={p.name: recipe.budget(p.name) for p in recipe.policy},
        )


def held_out_set(sections: EvalSections) -> list[tuple[str, dict[str, Any]]]:
    """(key, sample) of the held-out tasks: eval.path, else the workflow's dataset() built with
    eval.options over workflow.options and seed eval.seed (run.seed + 1 when unset)."""
    cfg = sections.eval
    if cfg.path:
        if not Path(cfg.path).is_file():
            raise RecipeError(
                f"held-out evaluation file not found: {cfg.path}",
                hint="eval.path must name a JSONL file on the controller's machine",
            )
        rows = read_jsonl(Path(cfg.path))[: cfg.max_tasks]
    else:
        from astraflow import plugins

        cls = plugins.load("workflows", sections.workflow.name)
        workflow = cls(cls.Config.model_validate({**sections.workflow.options, **cfg.options}))
        seed = sections.seed + 1 if cfg.seed is None else cfg.seed
        rows = []
        for row in workflow.dataset(seed, cfg.max_tasks):
            rows.append(row)
            if len(rows) >= cfg.max_tasks:
                break
    if not rows:
        raise RecipeError("the held-out evaluation set is empty", hint="check eval.path / eval.options")
    return [(prompt_key(r), dict(r)) for r in rows]


def without_held_out(epochs: Epochs, held_out: set[str]) -> Epochs:
    """The training prompt stream minus every sample whose content is in the held-out set."""

    def epoch(n: int) -> Iterator[dict[str, Any]]:
        return (s for s in epochs(n) if identity(s) not in held_out)

    return epoch


class Evaluator:
    """The run's eval rounds: scheduling at version boundaries, leasing rule, results, aggregation."""

    def __init__(self, sections: EvalSections, store: Store, ledger: Ledger, roles: dict[str, str]) -> None:
        cfg = sections.eval
        self.cfg = cfg
        self.budgets = sections.budgets
        self.store = store
        self.ledger = ledger
        self.roles = roles
        self.items = held_out_set(sections)
        called = list(dict.fromkeys(roles.values()))
        self.policies = cfg.policies or [p for p in sections.trainable if p in called]
        if any(p not in called for p in self.policies):
            raise RecipeError(
                f"eval.policies {self.policies}: the workflow calls only {called}",
                hint="evaluate policies that the workflow's roles map to",
            )
        self.open_tasks: dict[int, tuple[str, int]] = {}
        """Task id -> (policy, version) of every eval task not yet recorded."""
        self.open_rounds: set[tuple[str, int]] = set()
        self.reload()
        store.on_rollback.append(self.reload)

    def reload(self) -> None:
        """Read the open rounds and tasks from the store (at start, and after a rolled-back transaction)."""
        self.open_rounds = eval_rounds.open_rounds(self.store)
        self.open_tasks = eval_rounds.open_eval_tasks(self.store)

    def identities(self) -> set[str]:
        """Content identities of the held-out samples (excluded from training)."""
        return {identity(s) for _, s in self.items}

    # ----- scheduling -------------------------------------------------------------------------------

    def schedule(self, policy: str, version: int, step: int) -> int:
        """Queue one round of (policy, version) unless it exists; returns tasks queued. Call inside the
        write transaction that recorded the version, so a round is never lost nor queued twice."""
        if policy not in self.policies:
            return 0
        if eval_rounds.round_exists(self.store, policy, version):
            return 0
        now = time.time()
        task_policies = list(dict.fromkeys(self.roles.values()))
        with self.store.write():
            eval_rounds.add_round(self.store, policy, version, step, len(self.items), now)
            for key, sample in self.items:
                tid = self.ledger.enqueue(
                    f"eval/{policy}/{version}/{key}",
                    {"key": key, **sample},
                    self.roles,
                    self.cfg.samples,
                    read_only=task_policies,
                )
                eval_rounds.add_eval_task(self.store, tid, policy, version, key)
                self.open_tasks[tid] = (policy, version)
        self.open_rounds.add((policy, version))
        return len(self.items)

    def on_start(self) -> None:
        """Queue the version-0 round of every evaluated policy (once per run)."""
        if self.cfg.at_start:
            for p in self.policies:
                self.schedule(p, 0, 0)

    def on_version(self, policy: str, version: int, step: int) -> None:
        """Queue a round if this version is due (a multiple of every_versions, or the last one)."""
        every = self.cfg.every_versions
        last = self.cfg.at_end and step >= self.budgets[policy]
        if (every and version % every == 0) or last:
            self.schedule(policy, version, step)

    # ----- leasing and results ------------------------------------------------------------------------

    def is_eval(self, task_id: int) -> bool:
        """True for an eval task not yet recorded."""
        return task_id in self.open_tasks

    def may_lease(self, task: TaskRow, loaded: dict[str, int]) -> bool:
        """Only a worker already holding the round's version evaluates it."""
        policy, version = self.open_tasks[task.id]
        return loaded.get(policy, 0) >= version

    def group_sizes(self, task: TaskRow) -> dict[str, int]:
        """Every policy of an eval task samples eval.samples times."""
        return dict.fromkeys(task.policies, self.cfg.samples)

    def pending(self) -> bool:
        """True while a round is not yet aggregated."""
        return bool(self.open_rounds)

    def record(self, task_id: int, episodes: AnyEpisodes) -> None:
        """Store an accepted eval task's per-sample rewards (call inside the result's transaction)."""
        policy, _version = self.open_tasks.pop(task_id)
        episodes = pack_episodes(episodes)
        rewards: list[float] = []
        versions: list[int] = []
        for ep in episodes:
            mine = [s for s in ep.sequences if s.policy == policy]
            if mine:
                # one sample per episode: a policy playing several turns or roles gets their mean
                rewards.append(sum(s.reward for s in mine) / len(mine))
                versions.extend(
                    v for s in mine for v, mk in zip(packed.ints(s.versions), s.loss_mask, strict=True) if mk
                )
        eval_rounds.record_rewards(self.store, task_id, rewards, min(versions, default=-1))

    def finish_rounds(self) -> list[dict[str, Any]]:
        """Aggregate and close every open round none of whose tasks is queued or leased any more; returns
        their metrics rows (call inside a write transaction, write the rows after it commits)."""
        rows: list[dict[str, Any]] = []
        for policy, version in sorted(self.open_rounds):
            if eval_rounds.tasks_in_flight(self.store, policy, version):
                continue
            row = self._aggregate(policy, version)
            for tid in eval_rounds.close_round(self.store, policy, version, row, row["time"]):
                self.open_tasks.pop(tid, None)  # failed every attempt
            self.open_rounds.discard((policy, version))
            _log.info(
                "eval of %s version %d: %s",
                policy,
                version,
                ", ".join(f"{k[5:]} {v:.3f}" for k, v in row.items() if k.startswith("eval/")),
            )
            rows.append(row)
        return rows

    def _aggregate(self, policy: str, version: int) -> dict[str, Any]:
        """avg@n and pass@k of a round over its recorded tasks."""
        step = eval_rounds.round_step(self.store, policy, version)
        done, total = eval_rounds.round_results(self.store, policy, version)
        per_task = [rs for rs, _ in done if rs]
        n = self.cfg.samples
        row: dict[str, Any] = {
            "kind": "eval",
            "policy": policy,
            "version": version,
            "step": step,
            "time": time.time(),
            "eval/tasks": len(per_task),
            "eval/tasks_errored": total - len(per_task),
        }
        if per_task:
            row[f"eval/avg@{n}"] = sum(sum(rs) / len(rs) for rs in per_task) / len(per_task)
            for k in sorted(set(self.cfg.k)):
                est = [pass_at_k(len(rs), sum(r >= self.cfg.correct_at for r in rs), k) for rs in per_task]
                row[f"eval/pass@{k}"] = sum(est) / len(est)
            mins = [v for _, v in done if v >= 0]
            if mins:
                row["eval/version_min"] = min(mins)
        return row

"""The task queue's supply and the shape of a queued task: prompts are queued through admission and
the curators (`TaskQueue.refill`), and a task is leased with its group sizes and sampling
(`TaskShapes`: the recipe's, or the eval round's for a held-out task)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astraflow.dataflow.admission import Admission
from astraflow.dataflow.control import RunControl
from astraflow.dataflow.evaluation import Evaluator
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.source import PromptSource
from astraflow.roles.controller.run_end import RunEnd
from astraflow.state.ledger import Ledger, TaskRow
from astraflow.state.store import Store


@dataclass(frozen=True, slots=True)
class TaskShapes:
    """Group sizes and sampling of a task, for its lease and for checking its result."""

    evals: Evaluator | None
    group_sizes: dict[str, int]
    """Policy -> the recipe's group size."""

    def is_eval(self, task_id: int) -> bool:
        """Whether a task belongs to a held-out eval round."""
        return self.evals is not None and self.evals.is_eval(task_id)

    def sizes(self, task: TaskRow) -> dict[str, int]:
        """Policy -> group size of a task: the recipe's, or eval.samples for an eval task."""
        if self.evals is not None and self.evals.is_eval(task.id):
            return self.evals.group_sizes(task)
        return {p: self.group_sizes.get(p, task.group_size) for p in task.policies}

    def sampling(self, task: TaskRow) -> dict[str, float | int]:
        """Sampling overrides of a task: eval.sampling for an eval task, none otherwise."""
        if self.evals is not None and self.evals.is_eval(task.id):
            return self.evals.cfg.sampling.overrides()
        return {}


@dataclass(frozen=True, slots=True)
class TaskQueue:
    """What queues new tasks: the prompt source, the curators, admission and the operator's pauses."""

    store: Store
    ledger: Ledger
    source: PromptSource
    pipeline: Pipeline
    admission: Admission
    control: RunControl
    run: RunEnd
    roles: dict[str, str]
    """Workflow role -> the policy that plays it."""
    task_policies: list[str]
    group_sizes: dict[str, int]
    group_size: int
    """The largest group size: a task's own."""

    def refill(self, limit: int = 1024) -> int:
        """Queue prompts through admission and the curators; returns how many tasks were queued."""
        if self.run.stopping():
            return 0
        plan = self.control.admit(self.admission.plan(self.roles, self.group_sizes))[:limit]
        if not plan:
            return 0
        offered = 0
        queue: list[tuple[str, dict[str, Any], list[str]]] = []
        with self.store.write():
            while len(queue) < len(plan) and offered < self.admission.offer_limit(len(plan)):
                key, sample = self.source.next()
                offered += 1
                feeds = plan[len(queue)]
                if self.pipeline.submit(key, sample, feeds):
                    skip = [p for p in self.task_policies if p not in feeds]
                    queue.append((key, {"key": key, **sample}, skip))
            self.ledger.enqueue_many(queue, self.roles, self.group_size)
            self.source.save()
            if offered:
                # the curators' draws commit with the tasks they queued
                for pol in self.task_policies:
                    self.pipeline.save(pol)
        return len(queue)

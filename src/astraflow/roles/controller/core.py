"""The controller's state: what it owns, composed of the parts the handlers take.

`ControllerCore` holds the store, the task ledger, the buffers and data pipelines, the member table,
the parked long polls, the policies' versions (policy_versions.py), the run's end (run_end.py), the
task queue (task_queue.py) and the metrics row (metrics_row.py). The handlers (members.py, tasks.py,
results.py, batches.py, versions.py) take only the parts they read, which `Controller` (service.py,
with the message routing and the loop) hands them, as it hands the periodic work (lifecycle.py) its
own; none of them takes the core.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from pathlib import Path

from astraflow.config.load import role_map
from astraflow.config.recipe import Recipe
from astraflow.dataflow.admission import AdmissionSections, admission_for
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.control import RunControl
from astraflow.dataflow.evaluation import EvalSections, Evaluator, without_held_out
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.source import PromptSource, workflow_epochs
from astraflow.dataflow.stall import Progress
from astraflow.dataflow.validate import ResultChecker
from astraflow.metrics.sinks import Sinks
from astraflow.protocol import messages as m
from astraflow.roles.controller.long_polls import LongPolls
from astraflow.roles.controller.metrics_row import StepMetrics
from astraflow.roles.controller.parked import ParkedRequests
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.progress import made_progress
from astraflow.roles.controller.run_end import RunEnd
from astraflow.roles.controller.task_queue import TaskQueue, TaskShapes
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.roles.member_sections import WelcomeSections
from astraflow.roles.member_table import MemberTable
from astraflow.state import batches
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store

RETRY_S = 0.2
"""retry_after_s told to members when nothing is available yet."""


class ControllerCore:
    """The run's state as the controller holds it, and the reads and transitions the IO side
    and the tests use (each one delegates to the part that holds it)."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, store: Store, *, allow_recipe_change: bool = False
    ) -> None:
        self.recipe = recipe
        self.allow_recipe_change = allow_recipe_change
        self.run_dir = run_dir
        self.store = store
        # the one writer keeps which steps took their batch (every task, batch and version message asks)
        batches.keep_steps(store)
        rc = recipe.rollout
        self.ledger = Ledger(store, lease_timeout_s=rc.lease_timeout_s, max_attempts=rc.max_attempts)
        self.pipeline = Pipeline(recipe.policy, store, seed=recipe.run.seed)
        self.buffer = Buffer(store, order=self.pipeline.order, replay_count=self.pipeline.replay_count)
        self.roles = role_map(recipe)
        self.task_policies = list(dict.fromkeys(self.roles.values()))
        self.group_sizes = {p: recipe.get_policy(p).group_size for p in self.task_policies}
        self.group_size = max(self.group_sizes.values())
        self.admission = admission_for(
            AdmissionSections.of(recipe), store, self.pipeline, self.roles, kept=self.buffer
        )
        self.progress = Progress(time.time())
        self.evals = (
            Evaluator(EvalSections.of(recipe), store, self.ledger, self.roles) if recipe.eval else None
        )
        """Held-out evaluation rounds (dataflow/evaluation.py); None without an [eval] table."""
        epochs = workflow_epochs(recipe)
        if self.evals is not None:
            epochs = without_held_out(epochs, self.evals.identities())
        self.source = PromptSource(epochs, store)
        self.checker = ResultChecker(recipe)
        self.draining: set[str] = set()
        """Members asked to leave (`astraflow leave`): they get no new tasks."""
        self.control = RunControl(store)
        """Paused admission and an operator's stop (`astraflow ctl`, the dashboard's keys)."""
        self.welcome = WelcomeSections(recipe, self.roles)
        """The recipe's sections a Welcome carries to each kind of member (roles/member_sections.py)."""
        self.polls = LongPolls()
        """Long polls (long_polls.py): held requests and the events that answer them."""
        self.members = MemberTable(store)
        """Live members' last_seen, loaded versions and slots in memory, flushed every FLUSH_S
        (roles/member_table.py): a heartbeat costs no write, the liveness check no scan."""
        self.accounting = MemberAccounting(store, recipe)
        """Per-member failures, quarantine, lease share and heartbeat rate (roles/member_accounting.py)."""
        self.policy_versions = PolicyVersions(
            store,
            {p.name: recipe.budget(p.name) for p in recipe.trainable()},
            relays=bool(recipe.weights.relays),
            member_timeout_s=recipe.controller.member_timeout_s,
        )
        """The newest versions members are told of, the trainers' offers, the budgets (policy_versions.py)."""
        self.run = RunEnd(
            store,
            self.control,
            self.policy_versions,
            self.evals,
            max_failed_tasks=recipe.rollout.max_failed_tasks,
        )
        """Whether and why the run ends (run_end.py)."""
        self.sinks = Sinks.from_specs(
            [(s.name, s.options) for s in recipe.metrics.sinks], run_dir, report=self.sink_event
        )
        self.shapes = TaskShapes(self.evals, self.group_sizes)
        """A task's group sizes and sampling (task_queue.py)."""
        self.queue = TaskQueue(
            store,
            self.ledger,
            self.source,
            self.pipeline,
            self.admission,
            self.control,
            self.run,
            self.roles,
            self.task_policies,
            self.group_sizes,
            self.group_size,
        )
        """Queues prompts through admission and the curators (task_queue.py)."""
        self.step_metrics = StepMetrics(
            store,
            self.buffer,
            self.ledger,
            self.pipeline,
            {p.name: deque([(time.time(), 0)], maxlen=6) for p in recipe.policy},
            archived=recipe.controller.retention.keep_steps is not None,
        )
        """A finished step's metrics row (metrics_row.py)."""

    @property
    def parked(self) -> ParkedRequests:
        """The held requests (roles/controller/parked.py), as `polls` keeps them."""
        return self.polls.parked

    @property
    def failed(self) -> str | None:
        """The error the run failed with (it ends with exit 1), or None."""
        return self.run.failed

    @property
    def finished_at(self) -> float | None:
        """When the run's end was decided, or None."""
        return self.run.finished_at

    # ----- reads ----------------------------------------------------------------------------------

    def finished(self) -> bool:
        """True once every trainable policy reached its step budget."""
        return self.policy_versions.budgets_met()

    def stopping(self) -> bool:
        """True once members should stop: every budget (and the last eval round) met, a stop, or a failure."""
        return self.run.stopping()

    def evals_pending(self) -> bool:
        """True while a held-out eval round is not yet aggregated."""
        return self.run.evals_pending()

    def versions(self) -> list[m.VersionInfo]:
        """The newest version of each policy that has one."""
        return self.policy_versions.latest()

    # ----- transitions --------------------------------------------------------------------------

    def flush_touches(self) -> None:
        """Write the heartbeats seen since the last flush (last_seen, loaded version, slots) at once."""
        self.members.flush()

    def made_progress(self, now: float | None = None) -> None:
        """A result was accepted, a batch recorded or a version published: the run moves."""
        made_progress(self.store, self.progress, now)

    def refill(self, limit: int = 1024) -> int:
        """Queue prompts through admission and the curators; returns how many tasks were queued."""
        return self.queue.refill(limit)

    def sink_event(self, kind: str, detail: str) -> None:
        """Record a metric sink's failure or recovery as an event (`status`, the dashboard, `up`)."""
        with self.store.write():
            self.store.add_event(kind, detail[:1000])


def settle_heap() -> None:
    """After start: collect, then take every object alive now (modules, recipe, state read back) out of
    the cyclic collector's sight (`gc.freeze`), so that a full collection no longer walks them; objects
    made per message are collected as before. Only in a process that is the controller's."""
    gc.collect()
    gc.freeze()

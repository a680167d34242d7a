"""The controller's state: what it owns and the reads every handler shares.

`ControllerCore` holds the store, the task ledger, the buffers and data pipelines, the member table,
the parked long polls and the run's end state. The handlers (members.py, tasks.py, results.py,
batches.py, versions.py), the periodic work (lifecycle.py) and the metrics row (metrics_row.py) are
functions over it; `Controller` (service.py) adds the message routing and the loop.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from astraflow import log
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
from astraflow.roles.controller.parked import ParkedRequests
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.roles.member_sections import sections_for
from astraflow.roles.member_table import MemberTable
from astraflow.state.ledger import Ledger, TaskRow
from astraflow.state.store import Store

if TYPE_CHECKING:
    from astraflow.weights.relay import RelayDirectory

_log = log.get("controller")

RETRY_S = 0.2
"""retry_after_s told to members when nothing is available yet."""


class ControllerCore:
    """The run's state as the controller holds it, and the reads and transitions every handler shares."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, store: Store, *, allow_recipe_change: bool = False
    ) -> None:
        self.recipe = recipe
        self.allow_recipe_change = allow_recipe_change
        self.run_dir = run_dir
        self.store = store
        rc = recipe.rollout
        self.ledger = Ledger(store, lease_timeout_s=rc.lease_timeout_s, max_attempts=rc.max_attempts)
        self.pipeline = Pipeline(recipe.policy, store, seed=recipe.run.seed)
        self.buffer = Buffer(store, order=self.pipeline.order, replay_count=self.pipeline.replay_count)
        self.roles = role_map(recipe)
        self.task_policies = list(dict.fromkeys(self.roles.values()))
        self.group_sizes = {p: recipe.get_policy(p).group_size for p in self.task_policies}
        self.group_size = max(self.group_sizes.values())
        self.admission = admission_for(AdmissionSections.of(recipe), store, self.pipeline, self.roles)
        self.progress = Progress(time.time())
        self.evals = (
            Evaluator(EvalSections.of(recipe), store, self.ledger, self.roles) if recipe.eval else None
        )
        """Held-out evaluation rounds (dataflow/evaluation.py); None without an [eval] table."""
        epochs = workflow_epochs(recipe)
        if self.evals is not None:
            epochs = without_held_out(epochs, self.evals.identities())
        self.source = PromptSource(epochs, store)
        self.stop_requested = False
        self.exit_code = 0
        self.finished_at: float | None = None
        self.rate_hist: dict[str, deque[tuple[float, int]]] = {
            p.name: deque([(time.time(), 0)], maxlen=6) for p in recipe.policy
        }
        self.last_tick = 0.0
        self.last_prune = 0.0
        self.checker = ResultChecker(recipe)
        self.failed: str | None = None
        """Set (to the last error) once max_failed_tasks tasks in a row failed: the run ends with exit 1."""
        self.draining: set[str] = set()
        """Members asked to leave (`astraflow leave`): they get no new tasks."""
        self.control = RunControl(store)
        """Paused admission and an operator's stop (`astraflow ctl`, the dashboard's keys)."""
        self.welcome_sections: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        """(role, policies) -> the recipe's sections a Welcome carries to such a member
        (roles/member_sections.py), dumped at the first Hello of each."""
        self.sinks = Sinks.from_specs(
            [(s.name, s.options) for s in recipe.metrics.sinks], run_dir, report=self.sink_event
        )
        self.polls = LongPolls()
        """Long polls (long_polls.py): held requests and the events that answer them."""
        self._versions: list[m.VersionInfo] | None = None
        self._finished: bool | None = None
        """Read-through caches of the policies' versions and budgets: both change only when a version is
        recorded (versions_changed), and heartbeats of thousands of members read them."""
        self.members = MemberTable(store)
        """Live members' last_seen, loaded versions and slots in memory, flushed every FLUSH_S
        (roles/member_table.py): a heartbeat costs no write, the liveness check no scan."""
        self.offers: dict[str, tuple[int, list[m.WeightOffer]]] = {}
        """Policy -> (version, the faster weight paths its trainer offered for it); in memory only: after a
        restart workers pull the current version from the weight server until the next one."""
        self.relay_dir: RelayDirectory | None = None
        """Which members of a region hold which versions (`[weights] relays`; made at first use)."""
        self.accounting = MemberAccounting(store, recipe)
        """Per-member failures, quarantine, lease share and heartbeat rate (roles/member_accounting.py)."""

    @property
    def parked(self) -> ParkedRequests:
        """The held requests (roles/controller/parked.py), as `polls` keeps them."""
        return self.polls.parked

    # ----- reads ----------------------------------------------------------------------------------

    def finished(self) -> bool:
        """True once every trainable policy reached its step budget."""
        if self._finished is None:
            steps = {p["name"]: int(p["step"]) for p in self.store.policies()}
            self._finished = all(
                steps.get(p.name, 0) >= self.recipe.budget(p.name) for p in self.recipe.trainable()
            )
        return self._finished

    def stopping(self) -> bool:
        """True once members should stop: every budget (and the last eval round) met, a stop, or a failure."""
        return (
            self.failed is not None or self.control.stopped or (self.finished() and not self.evals_pending())
        )

    def evals_pending(self) -> bool:
        """True while a held-out eval round is not yet aggregated."""
        return self.evals is not None and self.evals.pending()

    def versions(self) -> list[m.VersionInfo]:
        """The newest version of each policy that has one."""
        if self._versions is None:
            self._versions = [
                m.VersionInfo(
                    policy=v["policy"],
                    version=v["version"],
                    weights_addr=v["weights_addr"] or "",
                    sha256=v["sha256"] or "",
                    offers=self._offers_for(v["policy"], v["version"]),
                )
                for v in self.store.latest_versions()
            ]
        return list(self._versions)

    def sections_for(self, role: str, policies: list[str]) -> dict[str, Any]:
        """What a Welcome carries of the recipe to a member of `role` serving `policies` (checked
        Hello): only the sections that role reads."""
        key = (role, tuple(policies) if role == "trainer" else ())
        doc = self.welcome_sections.get(key)
        if doc is None:
            doc = self.welcome_sections[key] = sections_for(self.recipe, role, policies, self.roles)
        return doc

    def versions_changed(self) -> None:
        """Forget the cached versions and budgets (a version was recorded)."""
        self._versions = None
        self._finished = None

    def versions_for(self, member: dict[str, Any], beat: m.Heartbeat | None = None) -> list[m.VersionInfo]:
        """The newest versions as `member` should pull them: with `[weights] relays`, each names the
        relays of the member's region that hold it (a heartbeat first updates the directory)."""
        infos = self.versions()
        if not self.recipe.weights.relays:
            return infos
        from astraflow.weights.relay import RelayDirectory

        now = time.time()
        if self.relay_dir is None:
            self.relay_dir = RelayDirectory(self.recipe.controller.member_timeout_s)
        relay_dir = self.relay_dir
        mid, region = str(member["id"]), str(member.get("region") or "")
        if beat is not None:
            relay_dir.update(mid, region, beat.relay_addr, dict(beat.loaded), now)
        # the cached infos are shared by every member: each gets copies naming its own region's relays
        return [
            msgspec.structs.replace(
                info, relays=relay_dir.relays_for(mid, region, info.policy, info.version, now)
            )
            if info.weights_addr
            else info
            for info in infos
        ]

    def _offers_for(self, policy: str, version: int) -> list[m.WeightOffer]:
        held = self.offers.get(policy)
        return held[1] if held is not None and held[0] == version else []

    def is_eval(self, task_id: int) -> bool:
        """Whether a task belongs to a held-out eval round."""
        return self.evals is not None and self.evals.is_eval(task_id)

    def task_sizes(self, task: TaskRow) -> dict[str, int]:
        """Policy -> group size of a task: the recipe's, or eval.samples for an eval task."""
        if self.evals is not None and self.evals.is_eval(task.id):
            return self.evals.group_sizes(task)
        return {p: self.group_sizes.get(p, task.group_size) for p in task.policies}

    def task_sampling(self, task: TaskRow) -> dict[str, float | int]:
        """Sampling overrides of a task: eval.sampling for an eval task, none otherwise."""
        if self.evals is not None and self.evals.is_eval(task.id):
            return self.evals.cfg.sampling.overrides()
        return {}

    # ----- transitions every handler shares ------------------------------------------------------

    def flush_touches(self) -> None:
        """Write the heartbeats seen since the last flush (last_seen, loaded version, slots) at once."""
        self.members.flush()

    def made_progress(self, now: float | None = None) -> None:
        """A result was accepted, a batch recorded or a version published: the run moves."""
        t = time.time() if now is None else now
        if self.progress.warned_at is not None:
            with self.store.write():
                self.store.add_event("unstalled", f"progress after {t - self.progress.last:.0f}s")
            self.progress.warned_at = None
        self.progress.last = t

    def refill(self, limit: int = 1024) -> int:
        """Queue prompts through admission and the curators; returns how many tasks were queued."""
        if self.stopping():
            return 0
        plan = self.control.admit(self.admission.plan(self.roles, self.group_sizes))[:limit]
        if not plan:
            return 0
        queued, offered = 0, 0
        with self.store.write():
            while queued < len(plan) and offered < self.admission.offer_limit(len(plan)):
                key, sample = self.source.next()
                offered += 1
                feeds = plan[queued]
                if self.pipeline.submit(key, sample, feeds):
                    skip = [p for p in self.task_policies if p not in feeds]
                    self.ledger.enqueue(key, {"key": key, **sample}, self.roles, self.group_size, skip)
                    queued += 1
            self.source.save()
            if offered:
                # the curators' draws commit with the tasks they queued
                for pol in self.task_policies:
                    self.pipeline.save(pol)
        return queued

    def end_run_failed(self, reason: str) -> None:
        """End the run with exit 1 (members are told to stop); the first reason is kept."""
        if self.failed is not None:
            return
        self.failed = reason
        self.finished_at = time.time()
        with self.store.write():
            self.store.add_event("run_failed", reason[:1000])
        _log.error("%s; ending the run", reason)

    def sink_event(self, kind: str, detail: str) -> None:
        """Record a metric sink's failure or recovery as an event (`status`, the dashboard, `up`)."""
        with self.store.write():
            self.store.add_event(kind, detail[:1000])


def summary(text: str) -> str:
    """The last non-empty line of an error (a traceback's summary line), capped."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]

"""How the run ends: every step budget (and the last eval round) met, an operator's stop, or a failure.

`RunEnd` holds the failure and the moment the end was decided, and answers `stopping` (members are told
to stop) for the handlers, the periodic work and the loop alike.
"""

from __future__ import annotations

import time

from astraflow import log
from astraflow.dataflow import failures
from astraflow.dataflow.control import RunControl
from astraflow.dataflow.evaluation import Evaluator
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.state.store import Store

_log = log.get("controller")


class RunEnd:
    """Whether and why the run ends; members learn it from their next reply."""

    def __init__(
        self,
        store: Store,
        control: RunControl,
        versions: PolicyVersions,
        evals: Evaluator | None,
        *,
        max_failed_tasks: int,
    ) -> None:
        self.store = store
        self.control = control
        self.versions = versions
        self.evals = evals
        self.max_failed_tasks = max_failed_tasks
        """rollout.max_failed_tasks: this many tasks in a row failing every attempt end the run."""
        self.failed: str | None = None
        """Set (to the last error) once the run failed: it ends with exit 1."""
        self.finished_at: float | None = None
        """When the end was decided (members are told to stop from then on)."""

    def evals_pending(self) -> bool:
        """True while a held-out eval round is not yet aggregated."""
        return self.evals is not None and self.evals.pending()

    def stopping(self) -> bool:
        """True once members should stop: every budget (and the last eval round) met, a stop, or a failure."""
        return (
            self.failed is not None
            or self.control.stopped
            or (self.versions.budgets_met() and not self.evals_pending())
        )

    def fail(self, reason: str) -> None:
        """End the run with exit 1 (members are told to stop); the first reason is kept."""
        if self.failed is not None:
            return
        self.failed = reason
        self.finished_at = time.time()
        with self.store.write():
            self.store.add_event("run_failed", reason[:1000])
        _log.error("%s; ending the run", reason)

    def check_failed_streak(self, error: str) -> None:
        """End the run (exit 1) once max_failed_tasks tasks in a row failed every attempt."""
        n = self.max_failed_tasks
        if self.failed is None and failures.failed_streak(self.store, n):
            self.failed = failures.tail(error, 2000)
            self.finished_at = time.time()
            self.store.add_event("run_failed", f"{n} tasks in a row failed; last error: {summary(error)}")
            _log.error(
                "%d tasks in a row failed every attempt (rollout.max_failed_tasks); ending the run. Last error:\n%s",
                n,
                failures.tail(error, 2000),
            )


def summary(text: str) -> str:
    """The last non-empty line of an error (a traceback's summary line), capped."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]

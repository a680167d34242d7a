"""Metric sinks: plugins of the `astraflow.metric_sinks` group that receive every step's metrics row.

The controller builds one `Sinks` at start and calls `write` once per recorded step, after the step's
transaction committed. metrics.jsonl is itself the built-in `jsonl` sink and is always on (`up`'s
progress, the dashboard, `runs`, `export` and `plot` read it); a recipe adds more under
`[metrics] sinks`.

A failure is never silent. The `jsonl` sink is the run's record of its steps: when it cannot write,
`write` raises SinkFailed and the controller ends the run with that reason. An optional sink that
raises keeps its undelivered rows and is retried with exponential backoff (`retry`, from the
controller's periodic work); every failed attempt, a recovery and rows it had to give up are reported
through the `report` callback (the controller records them as events) and the log.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from astraflow import log
from astraflow.errors import AstraflowError

_log = log.get("metrics")

ALWAYS = "jsonl"
"""The sink every run writes (metrics.jsonl)."""
RETRY_FIRST_S = 1.0
"""Seconds before the first retry of a failed optional sink; doubled after each failed attempt."""
RETRY_MAX_S = 60.0
"""Longest wait between retries of a failed optional sink."""
MAX_PENDING = 10_000
"""Rows kept for a failing optional sink; older ones are given up (and reported) beyond that."""

_JSONL_HINT = (
    "free disk space or fix the run directory's permissions, then restart the controller on the same "
    "run directory: the missing rows are rewritten from state.db"
)

Report = Callable[[str, str], None]
"""(event kind, detail) of a sink failure, recovery or rows given up."""


class SinkFailed(AstraflowError):
    """The always-on jsonl sink cannot write: the run has no record of its steps and must stop."""


class SinkConfig(BaseModel):
    """Base of a sink's options (a sink without options may use it as is)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class MetricSink:
    """The contract: constructed with its options and the run directory; `write` gets every row."""

    Config: ClassVar[type[SinkConfig]] = SinkConfig

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        self.config = config if config is not None else self.Config()
        self.run_dir = run_dir

    def write(self, row: dict[str, Any]) -> None:
        """Record one metrics row (policy, step, version, time and numbers)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what the sink holds (called once at the controller's exit)."""


class Sinks:
    """The run's sinks, fed together: jsonl must write (SinkFailed otherwise), optional ones are retried."""

    def __init__(
        self,
        sinks: dict[str, MetricSink],
        report: Report | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sinks = sinks
        self.report: Report = report if report is not None else (lambda _kind, _detail: None)
        self.clock = clock
        self.pending: dict[str, deque[dict[str, Any]]] = {}
        """Rows not yet delivered to a failing optional sink, oldest first."""
        self.retry_at: dict[str, float] = {}
        self.attempts: dict[str, int] = {}
        """Failed attempts in a row of each failing optional sink."""
        self.given_up: dict[str, int] = {}
        """Rows a failing sink will never get (MAX_PENDING reached), reported once per failed attempt."""

    @classmethod
    def from_specs(
        cls, specs: list[tuple[str, dict[str, Any]]], run_dir: Path, report: Report | None = None
    ) -> Sinks:
        """Load `jsonl` and every named sink plugin with its options (fails loudly on a bad name)."""
        from astraflow import plugins

        wanted: dict[str, dict[str, Any]] = {ALWAYS: {}}
        for name, options in specs:
            wanted[name] = options
        out: dict[str, MetricSink] = {}
        for name, options in wanted.items():
            sink_cls = plugins.load("metric_sinks", name)
            config_cls = getattr(sink_cls, "Config", None)
            config = config_cls.model_validate(options) if config_cls is not None else None
            try:
                out[name] = sink_cls(config, run_dir)
            except OSError as exc:
                if name != ALWAYS:
                    raise
                raise SinkFailed(
                    f"metrics.jsonl cannot be opened ({type(exc).__name__}: {exc})", hint=_JSONL_HINT
                ) from exc
        return cls(out, report)

    def write(self, row: dict[str, Any]) -> None:
        """Give the row to every sink; raises SinkFailed when the jsonl sink cannot write it."""
        for name in list(self.sinks):
            if name == ALWAYS:
                try:
                    self.sinks[name].write(row)
                except Exception as exc:
                    raise SinkFailed(
                        f"metrics.jsonl cannot be written ({type(exc).__name__}: {exc})",
                        hint=_JSONL_HINT,
                    ) from exc
                continue
            queue = self.pending.setdefault(name, deque())
            queue.append(row)
            if len(queue) > MAX_PENDING:
                queue.popleft()
                self.given_up[name] = self.given_up.get(name, 0) + 1
            if len(queue) == 1 or self.clock() >= self.retry_at.get(name, 0.0):
                self._deliver(name)

    def retry(self) -> None:
        """Retry every failing optional sink whose backoff ran out (the controller calls this each tick)."""
        now = self.clock()
        for name, queue in self.pending.items():
            if queue and now >= self.retry_at.get(name, 0.0):
                self._deliver(name)

    def failing(self) -> dict[str, int]:
        """Optional sinks that currently fail -> rows waiting for them."""
        return {name: len(q) for name, q in self.pending.items() if q and self.attempts.get(name)}

    def _deliver(self, name: str) -> None:
        """Write the sink's waiting rows in order; on an error keep the rest and back off."""
        queue = self.pending[name]
        sink = self.sinks[name]
        try:
            while queue:
                sink.write(queue[0])
                queue.popleft()
        except Exception as exc:
            n = self.attempts[name] = self.attempts.get(name, 0) + 1
            wait = min(RETRY_FIRST_S * 2 ** (n - 1), RETRY_MAX_S)
            self.retry_at[name] = self.clock() + wait
            lost = self.given_up.pop(name, 0)
            detail = (
                f"metric sink {name!r} failed ({type(exc).__name__}: {str(exc)[:300]}); attempt {n}, "
                f"{len(queue)} rows waiting, next try in {wait:.0f}s"
                + (f"; {lost} oldest rows given up (more than {MAX_PENDING} waiting)" if lost else "")
            )
            _log.error("%s", detail, exc_info=n == 1)
            self.report("sink_failed", detail)
            return
        n = self.attempts.pop(name, 0)
        if n:
            detail = (
                f"metric sink {name!r} works again after {n} failed attempts; every waiting row delivered"
            )
            _log.warning("%s", detail)
            self.report("sink_recovered", detail)

    def close(self) -> None:
        """Deliver what optional sinks still wait for (one last try, reported if it fails), close every sink."""
        for name, queue in self.pending.items():
            if queue and self.attempts.get(name):
                self._deliver(name)
                if queue:
                    detail = f"metric sink {name!r}: {len(queue)} rows never delivered (the run ended)"
                    _log.error("%s", detail)
                    self.report("sink_failed", detail)
        for name in list(self.sinks):
            sink = self.sinks.pop(name)
            try:
                sink.close()
            except Exception as exc:
                _log.exception("metric sink %r failed to close", name)
                self.report("sink_failed", f"metric sink {name!r} failed to close: {exc}"[:500])

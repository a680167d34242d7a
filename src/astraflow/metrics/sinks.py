"""Metric sinks: plugins of the `astraflow.metric_sinks` group that receive every step's metrics row.

The controller builds one `Sinks` at start and calls `write` once per recorded step, after the step's
transaction committed. metrics.jsonl is itself the built-in `jsonl` sink and is always on (`up`'s
progress, the dashboard, `runs`, `export` and `plot` read it); a recipe adds more under
`[metrics] sinks`. A sink that raises is logged and switched off: observability never stops a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from astraflow import log

_log = log.get("metrics")

ALWAYS = "jsonl"
"""The sink every run writes (metrics.jsonl)."""


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
    """The run's sinks, fed together; a failing sink is disabled with one logged error."""

    def __init__(self, sinks: dict[str, MetricSink]) -> None:
        self.sinks = sinks

    @classmethod
    def from_specs(cls, specs: list[tuple[str, dict[str, Any]]], run_dir: Path) -> Sinks:
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
            out[name] = sink_cls(config, run_dir)
        return cls(out)

    def write(self, row: dict[str, Any]) -> None:
        """Give the row to every live sink."""
        for name in list(self.sinks):
            try:
                self.sinks[name].write(row)
            except Exception:  # a third-party sink's bug must not take the controller down
                _log.exception("metric sink %r failed; it is switched off for the rest of the run", name)
                self._drop(name)

    def close(self) -> None:
        """Close every sink."""
        for name in list(self.sinks):
            self._drop(name)

    def _drop(self, name: str) -> None:
        sink = self.sinks.pop(name)
        try:
            sink.close()
        except Exception:
            _log.exception("metric sink %r failed to close", name)

"""Metric sinks for Weights & Biases (offline mode: no network) and MLflow (a local file store).

Both packages are heavy (together about 165 MB and two minutes to install here), so they are optional
extras (`astraflow[wandb]`, `astraflow[mlflow]`) and imported only when a recipe names the sink.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from astraflow.errors import PluginError
from astraflow.metrics.sinks import MetricSink, SinkConfig

_SKIP = ("step", "policy", "time")
"""Row keys that index a point rather than being a metric."""


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's metrics: every number except the index keys (booleans count as numbers)."""
    return {k: float(v) for k, v in row.items() if k not in _SKIP and isinstance(v, int | float)}


class WandbSinkConfig(SinkConfig):
    """Options of the wandb sink."""

    project: str = "astraflow"
    """W&B project name."""
    mode: str = "offline"
    """offline (files under RUN/wandb, upload later with `wandb sync`), online or disabled."""
    dir: str = "."
    """Directory, relative to the run directory, under which W&B makes its `wandb/` folder."""


class WandbSink(MetricSink):
    """One W&B run per astraflow run; metrics as `POLICY/NAME` against each policy's own `POLICY/step`."""

    Config = WandbSinkConfig
    config: WandbSinkConfig

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        if self.config.mode not in ("offline", "online", "disabled"):
            raise PluginError(
                f"wandb sink: mode {self.config.mode!r}", hint="mode is offline, online or disabled"
            )
        try:
            import wandb
        except ImportError as exc:
            raise PluginError(
                "the wandb metric sink needs the wandb package", hint="pip install 'astraflow[wandb]'"
            ) from exc
        out = run_dir / self.config.dir
        out.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.config.project,
            name=run_dir.name,
            dir=str(out),
            mode=self.config.mode,  # type: ignore[arg-type,unused-ignore]  # typed only where wandb is installed
            reinit="create_new",
        )
        self.defined: set[str] = set()

    def write(self, row: dict[str, Any]) -> None:
        """Log the row's numbers under its policy, at its step."""
        policy = str(row.get("policy", "main"))
        if policy not in self.defined:
            # each policy has its own step axis: policies step at different rates
            self.run.define_metric(f"{policy}/step")
            self.run.define_metric(f"{policy}/*", step_metric=f"{policy}/step")
            self.defined.add(policy)
        data = {f"{policy}/{k}": v for k, v in _numbers(row).items()}
        data[f"{policy}/step"] = int(row.get("step", 0))
        self.run.log(data)

    def close(self) -> None:
        """Finish the W&B run (writes its files)."""
        self.run.finish()


class MlflowSinkConfig(SinkConfig):
    """Options of the mlflow sink."""

    tracking_uri: str = "mlruns"
    """A directory relative to the run directory (a file store), or a URI such as http://host:5000."""
    experiment: str = "astraflow"
    """Experiment name (made if missing)."""


class MlflowSink(MetricSink):
    """One MLflow run per astraflow run; metrics as `POLICY/NAME` at the row's step."""

    Config = MlflowSinkConfig
    config: MlflowSinkConfig

    def __init__(self, config: SinkConfig | None, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise PluginError(
                "the mlflow metric sink needs mlflow (or mlflow-skinny)",
                hint="pip install 'astraflow[mlflow]'",
            ) from exc
        uri = self.config.tracking_uri
        if "://" not in uri and not uri.startswith("file:"):
            uri = (run_dir / uri).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode behind this documented opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(self.config.experiment)
        exp_id = (
            exp.experiment_id if exp is not None else self.client.create_experiment(self.config.experiment)
        )
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id

    def write(self, row: dict[str, Any]) -> None:
        """Log the row's numbers under its policy, at its step, in one batch."""
        from mlflow.entities import Metric

        policy = str(row.get("policy", "main"))
        ms = int(float(row.get("time", time.time())) * 1000)
        step = int(row.get("step", 0))
        metrics = [Metric(f"{policy}/{k}", v, ms, step) for k, v in _numbers(row).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        """Mark the MLflow run finished."""
        self.client.set_terminated(self.run_id)

"""`astraflow bench ...`: benchmarks that print ratios against a baseline measured in the same run.

One module per family: `runs` (recipes through `astraflow up`: data, pipeline, e2e, trl), `engine`
(rollout, trainer, wire), `weights` (weights, broadcast, delta) and `plane` (dash, control); each
registers its commands on the one Typer app of `common`."""

from __future__ import annotations

from astraflow.cli.bench import engine, plane, runs, weights
from astraflow.cli.bench.common import app

__all__ = ["app", "engine", "plane", "runs", "weights"]

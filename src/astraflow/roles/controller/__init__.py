"""The controller service (docs/architecture.md, "controller"): one single-threaded loop that owns the
run's state and answers every member."""

from __future__ import annotations

from astraflow.roles.controller.service import (
    PRUNE_EVERY_S,
    RETRY_S,
    TICK_S,
    Controller,
    run_controller,
    with_trainer_metrics,
)

__all__ = ["PRUNE_EVERY_S", "RETRY_S", "TICK_S", "Controller", "run_controller", "with_trainer_metrics"]

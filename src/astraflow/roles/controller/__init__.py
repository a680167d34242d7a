"""The controller service (docs/architecture.md, "controller"): one single-threaded loop that owns the
run's state and answers every member.

Read it in this order: `core.py` (the state it owns) and the parts it composes, which the handlers take
instead of the core (`policy_versions.py`, `run_end.py`, `task_queue.py`, `progress.py`), `outcome.py`
(what a handler returns: the reply and the events it caused), the handlers over those parts, one module
per kind of message (`members.py`: Hello, Heartbeat, Bye, Leave; `tasks.py`: TaskRequest; `results.py`:
TaskResult, TaskResults; `batches.py`: BatchRequest; `versions.py`: VersionPublished; an operator's
Control is roles/run_control.py), `long_polls.py` (held requests answered by the events of the
handlers' outcomes), `metrics_row.py` (a step's metrics row and the sinks), `lifecycle.py` (start,
periodic work, stalls, exit) and `service.py` (the parts handed to each handler, message routing, the
poll loop), `coalesce.py` (results messages read in one poll taken as one) and `process.py`
(`run_controller`).
"""

from __future__ import annotations

from astraflow.roles.controller.core import RETRY_S
from astraflow.roles.controller.lifecycle import PRUNE_EVERY_S
from astraflow.roles.controller.metrics_row import with_trainer_metrics
from astraflow.roles.controller.process import run_controller
from astraflow.roles.controller.service import TICK_S, Controller

__all__ = ["PRUNE_EVERY_S", "RETRY_S", "TICK_S", "Controller", "run_controller", "with_trainer_metrics"]

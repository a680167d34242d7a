"""What `astraflow up` does when a child dies: the restart policy, one rule per role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astraflow import log
from astraflow.launch.supervisor import Child, Supervisor

_log = log.get("launcher")
MAX_TRAINER_RESTARTS = 2


@dataclass(frozen=True)
class RestartRule:
    """What `up` does when a child of one role dies (exits non-zero, or a service at all)."""

    limit: int
    """Restarts allowed before the death ends the run."""
    how: str = "restarting it"
    """How the restart is logged."""
    spare: bool = False
    """Past its limit, the run goes on while another child of its role still runs (RaaS workers)."""


def restart_rules(recipe: Any, max_raas_restarts: int) -> dict[str, RestartRule]:
    """The restart policy, by role (a controller is never restarted: its death ends the run)."""
    return {
        # a trainer resumes from its newest checkpoint and gets the recorded batches again
        "trainer": RestartRule(MAX_TRAINER_RESTARTS, "restarting it from its checkpoint"),
        "raas": RestartRule(max_raas_restarts, spare=True),
        "controller": RestartRule(0),
        **{f"service-{svc.name}": RestartRule(svc.max_restarts) for svc in getattr(recipe, "service", [])},
    }


def restart_or_fail(sup: Supervisor, rules: dict[str, RestartRule], child: Child, rc: int) -> bool:
    """Apply the restart policy to a dead child: True when the run goes on (restarted, or a spare)."""
    rule = rules.get(child.name if child.role == "service" else child.role, RestartRule(0))
    if child.restarts < rule.limit:
        _log.warning(
            "%s exited with %s; %s (%d/%d)", child.name, rc, rule.how, child.restarts + 1, rule.limit
        )
        sup.restart(child)
        return True
    if rule.spare and any(c.running for c in sup.children if c.role == child.role):
        _log.warning("%s exited with %s and will not be restarted again", child.name, rc)
        return True
    return False

"""What a launcher does when a role dies: the restart policy, one rule per role, shared by
`astraflow up` (child processes) and `launch ray` (actors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from astraflow import log
from astraflow.launch.supervisor import Child, Supervisor

_log = log.get("launcher")
MAX_TRAINER_RESTARTS = 2
"""Restarts of one trainer (from its newest checkpoint) before its death ends the run."""
MAX_RAAS_RESTARTS = 3
"""Restarts of one RaaS worker before it is given up on."""

Step = Literal["restart", "spare", "fail"]


@dataclass(frozen=True)
class RestartRule:
    """What a launcher does when a role of one kind dies (exits non-zero, or a service at all)."""

    limit: int
    """Restarts allowed before the death ends the run."""
    how: str = "restarting it"
    """How the restart is logged."""
    spare: bool = False
    """Past its limit, the run goes on while another child of its role still runs (RaaS workers)."""

    def after(self, restarts: int, others_running: bool) -> Step:
        """The step for a death after `restarts` earlier restarts: restart it, go on without it (a
        spare, while `others_running` of its role), or end the run."""
        if restarts < self.limit:
            return "restart"
        return "spare" if self.spare and others_running else "fail"


def restart_rules(recipe: Any, max_raas_restarts: int = MAX_RAAS_RESTARTS) -> dict[str, RestartRule]:
    """The restart policy, by role (a controller is never restarted: its death ends the run)."""
    return {
        # a trainer resumes from its newest checkpoint and gets the recorded batches again
        "trainer": RestartRule(MAX_TRAINER_RESTARTS, "restarting it from its checkpoint"),
        # a new process under the same member name: its leases go back to the queue when it says Hello
        "raas": RestartRule(max_raas_restarts, "replacing it", spare=True),
        "controller": RestartRule(0),
        **{f"service-{svc.name}": RestartRule(svc.max_restarts) for svc in getattr(recipe, "service", [])},
    }


def rule_for(rules: dict[str, RestartRule], role: str, name: str) -> RestartRule:
    """The rule of one role (a service's by its name); none allows no restart."""
    return rules.get(name if role == "service" else role, RestartRule(0))


def restart_or_fail(sup: Supervisor, rules: dict[str, RestartRule], child: Child, rc: int) -> bool:
    """Apply the restart policy to a dead child: True when the run goes on (restarted, or a spare)."""
    rule = rule_for(rules, child.role, child.name)
    step = rule.after(child.restarts, any(c.running for c in sup.children if c.role == child.role))
    if step == "restart":
        _log.warning(
            "%s exited with %s; %s (%d/%d)", child.name, rc, rule.how, child.restarts + 1, rule.limit
        )
        sup.restart(child)
        return True
    if step == "spare":
        _log.warning("%s exited with %s and will not be restarted again", child.name, rc)
        return True
    return False

"""An operator's Control message: pause/resume admission, stop the run (`astraflow ctl`, the dashboard's
keys). It takes only what it changes: the store (for its events) and the run's `RunControl`."""

from __future__ import annotations

from collections.abc import Callable

from astraflow import log
from astraflow.dataflow.control import RunControl
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.state.store import Store
from astraflow.transport.principal import Principal

_log = log.get("controller")
ACTIONS = ("pause", "resume", "stop")


def on_control(
    msg: m.Control,
    principal: Principal | None,
    *,
    store: Store,
    control: RunControl,
    policies: list[str],
    applied: Callable[[str], None],
) -> m.Msg:
    """Check who asks and what, apply it, record an event, then call `applied(action)` (the
    controller's follow-up: a resume is progress and refills the queue); the Ack's detail says what
    holds now."""
    refused = authz.control_refusal(principal)
    if refused is not None:
        _log.warning(
            "refused Control %s from %r: %s", msg.action[:16], principal and principal.name, refused[1]
        )
        return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
    if msg.action not in ACTIONS:
        return m.Error(rid=msg.rid, code="bad_request", message=f"action is one of {', '.join(ACTIONS)}")
    if msg.policy and msg.policy not in policies:
        return m.Error(
            rid=msg.rid,
            code="unknown_policy",
            message=f"no policy {msg.policy!r} in this run; policies: {policies}",
        )
    who = principal.name if principal is not None else "an unauthenticated operator"
    target = f"policy {msg.policy}" if msg.policy else "the whole run"
    with store.write():
        if msg.action == "pause":
            control.pause(msg.policy)
            store.add_event("admission_paused", f"{target} by {who}")
        elif msg.action == "resume":
            control.resume(msg.policy)
            store.add_event("admission_resumed", f"{target} by {who}")
        else:
            control.stop()
            store.add_event("stop_requested", f"by {who}; trainers finish their step and checkpoint")
    applied(msg.action)
    _log.info("%s (%s) by %s", msg.action, target, who)
    paused = sorted(control.paused)
    return m.Ack(rid=msg.rid, detail="stopping" if control.stopped else f"paused: {','.join(paused) or '-'}")

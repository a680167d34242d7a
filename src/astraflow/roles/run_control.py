"""The controller's handling of an operator's Control message: pause/resume admission, stop the run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astraflow import log
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.transport.principal import Principal

if TYPE_CHECKING:
    from astraflow.roles.controller import Controller

_log = log.get("controller")
ACTIONS = ("pause", "resume", "stop")


def on_control(ctl: Controller, msg: m.Control, principal: Principal | None) -> m.Msg:
    """Check who asks and what, apply it, record an event; the Ack's detail says what holds now."""
    refused = authz.control_refusal(principal)
    if refused is not None:
        _log.warning(
            "refused Control %s from %r: %s", msg.action[:16], principal and principal.name, refused[1]
        )
        return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
    if msg.action not in ACTIONS:
        return m.Error(rid=msg.rid, code="bad_request", message=f"action is one of {', '.join(ACTIONS)}")
    names = [p.name for p in ctl.recipe.policy]
    if msg.policy and msg.policy not in names:
        return m.Error(
            rid=msg.rid,
            code="unknown_policy",
            message=f"no policy {msg.policy!r} in this run; policies: {names}",
        )
    who = principal.name if principal is not None else "an unauthenticated operator"
    target = f"policy {msg.policy}" if msg.policy else "the whole run"
    with ctl.store.write():
        if msg.action == "pause":
            ctl.control.pause(msg.policy)
            ctl.store.add_event("admission_paused", f"{target} by {who}")
        elif msg.action == "resume":
            ctl.control.resume(msg.policy)
            ctl.store.add_event("admission_resumed", f"{target} by {who}")
        else:
            ctl.control.stop()
            ctl.store.add_event("stop_requested", f"by {who}; trainers finish their step and checkpoint")
    if msg.action == "resume":
        ctl.made_progress()  # the paused time is not a stall
        ctl.refill()
    _log.info("%s (%s) by %s", msg.action, target, who)
    paused = sorted(ctl.control.paused)
    return m.Ack(
        rid=msg.rid, detail="stopping" if ctl.control.stopped else f"paused: {','.join(paused) or '-'}"
    )

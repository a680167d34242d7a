"""Membership: a member joins (Hello), beats (Heartbeat), says Bye, or is asked to leave (Leave).

Handlers over the store, the member table and the task ledger; each returns its Outcome (outcome.py):
the reply, the events it caused, and the member whose held requests are void. Each takes only what it
reads and changes: Hello a `Joining`, Heartbeat, Bye and Leave their parts as keywords (the Heartbeat
the rids of the member's held requests as data, not the held-request table). A heartbeat reaches
`on_heartbeat` through beats.py, which rate-limits it and answers idle ones itself.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from astraflow import log
from astraflow.protocol import messages as m
from astraflow.roles import authz
from astraflow.roles.controller.beat_pace import BeatPace
from astraflow.roles.controller.outcome import Event, Outcome
from astraflow.roles.controller.policy_versions import PolicyVersions
from astraflow.roles.controller.run_end import RunEnd
from astraflow.roles.member_accounting import MemberAccounting
from astraflow.roles.member_sections import WelcomeSections
from astraflow.roles.member_table import MemberTable
from astraflow.state.ledger import Ledger
from astraflow.state.store import Store
from astraflow.transport.principal import Principal

_log = log.get("controller")


@dataclass(frozen=True, slots=True)
class Joining:
    """What a Hello reads and changes: the identity checks' inputs, the member's row and the leases of
    a previous process under its id, and what the Welcome carries."""

    store: Store
    ledger: Ledger
    members: MemberTable
    draining: set[str]
    """Members asked to leave: a new process under a draining id is not draining."""
    versions: PolicyVersions
    sections: WelcomeSections
    """The recipe's sections a member of each role reads (roles/member_sections.py)."""
    run_name: str
    policies: list[str]
    """The run's policy names: a Hello may name only these."""
    member_timeout_s: float
    """controller.member_timeout_s: how long a silent member still holds its id."""
    heartbeat_interval_s: float
    """controller.heartbeat_interval_s, told to the member in its Welcome."""
    pace: BeatPace
    """The idle interval told to the member in its Welcome (beat_pace.py)."""


def on_hello(ctx: Joining, ident: bytes, msg: m.Hello, principal: Principal | None = None) -> Outcome:
    """Check protocol, identity and role, register the member, send its sections and the versions."""
    checked = _checked_hello(ctx, ident, msg, principal)
    if isinstance(checked, m.Error):
        return Outcome(checked)
    msg = checked
    with ctx.store.write():
        prev = ctx.store.member(msg.member_id)
        released = 0
        if prev is not None and (prev.get("pid") != msg.pid or prev.get("host") != msg.host):
            # a new process under an id that fell silent holds none of the old one's tasks
            released = ctx.ledger.release_member(msg.member_id)
            # a drain was asked of the old process; the same process rejoining stays draining
            ctx.draining.discard(msg.member_id)
        ctx.store.upsert_member(
            msg.member_id,
            msg.role,
            policies=list(msg.policies),
            region=msg.region,
            hardware=msg.hardware,
            slots=msg.slots,
            pid=msg.pid,
            host=msg.host,
        )
        ctx.store.add_event(
            "member_joined" if prev is None else "member_rejoined",
            f"{msg.member_id} {msg.role}"
            + (f"; {released} leases of its previous process back" if released else ""),
        )
    ctx.members.joined(msg.member_id, time.time())
    _log.info("member %s joined as %s (%s)", msg.member_id, msg.role, msg.hardware or "?")
    welcome = m.Welcome(
        rid=msg.rid,
        run_name=ctx.run_name,
        sections=ctx.sections(msg.role, list(msg.policies)),
        heartbeat_interval_s=ctx.heartbeat_interval_s,
        versions=ctx.versions.latest(),
        idle_interval_s=ctx.pace.for_role(msg.role),
    )
    # a member joining (again) starts afresh: what it had held from before is void; its client already
    # failed those requests, and a late answer would grant tasks to nobody
    return Outcome(welcome, void=ident)


def _checked_hello(
    ctx: Joining, ident: bytes, msg: m.Hello, principal: Principal | None
) -> m.Hello | m.Error:
    """The Hello capped (authz.cap_hello), or why it is refused (protocol, identity, role, policies, keys)."""
    if msg.protocol != m.PROTOCOL_VERSION:
        return m.Error(
            rid=msg.rid,
            code="protocol_version",
            message=f"controller speaks protocol {m.PROTOCOL_VERSION}, member {msg.protocol}; install matching astraflow versions",
        )
    if msg.member_id.encode() != ident:
        return m.Error(rid=msg.rid, code="bad_identity", message="member_id must equal the socket identity")
    msg = authz.cap_hello(msg)
    # the identity checks read last_seen from the store: this member's (a trainer's: every member's)
    if msg.role == "trainer":
        ctx.members.flush()
    else:
        ctx.members.flush_member(msg.member_id)
    refused = authz.hello_refusal(
        ctx.store,
        msg,
        principal,
        policies=ctx.policies,
        # a live member that beats less often holds its id as long as it is not declared dead
        member_timeout_s=ctx.members.timeout(msg.member_id, ctx.member_timeout_s),
    )
    if refused is not None:
        _log.warning("refused Hello of %r as %s: %s", msg.member_id[:64], msg.role, refused[1])
        return m.Error(rid=msg.rid, code=refused[0], message=refused[1])
    return msg


def on_heartbeat(
    member: dict[str, Any],
    msg: m.Heartbeat,
    *,
    held: Collection[int],
    store: Store,
    ledger: Ledger,
    members: MemberTable,
    accounting: MemberAccounting,
    versions: PolicyVersions,
    run: RunEnd,
    lease_max_age_s: float,
) -> Outcome:
    """Touch the member, renew its leases, tell it the versions and whether to stop (the rate limit
    and the idle beats' fast path are beats.py's). `held` is the rids of the member's requests the
    controller holds (long polls): the ones it waits on that are neither held nor answered are `lost`."""
    now = time.time()
    new_error = bool(msg.error) and accounting.new_error(member["id"], msg.error)
    slots = msg.busy + msg.free
    # last_seen needs no durability (a restarted controller gives every member a fresh timer):
    # it is written with the other heartbeats of this tick, before the liveness check reads it
    members.touch(member["id"], now, dict(msg.loaded) if msg.loaded else None, slots if slots > 0 else None)
    if msg.active or new_error:
        with store.write():
            # only leases the worker reports working on are renewed, and none past the task timeout
            ledger.renew_tasks(member["id"], msg.active, now, max_age_s=lease_max_age_s)
            if new_error:
                store.add_event("member_error", f"{member['id']}: {msg.error[:500]}")
    if new_error:
        _log.warning("member %s reports: %s", member["id"], msg.error[:500])
    # Requests are handled in the order they arrive, so every request the member sent before this
    # heartbeat is answered (its reply is ahead of this one) or held; any other was never received.
    lost = [rid for rid in msg.waiting if rid not in held]
    infos = versions.for_member(member, msg)
    return Outcome(m.HeartbeatAck(rid=msg.rid, versions=infos, stop=run.stopping(), lost=lost))


def on_bye(
    member: dict[str, Any],
    msg: m.Bye,
    *,
    store: Store,
    ledger: Ledger,
    members: MemberTable,
    draining: set[str],
) -> Outcome:
    """Return the member's leases at once and mark it left."""
    with store.write():
        n = ledger.release_member(member["id"])
        store.set_member_status(member["id"], "left")
        members.gone(member["id"])
        store.add_event("member_left", f"{member['id']} ({msg.reason[:500]}); {n} leases back")
    draining.discard(member["id"])
    _log.info("member %s left (%s); %d tasks requeued", member["id"], msg.reason[:200] or "-", n)
    return Outcome(m.Ack(rid=msg.rid), (Event.RUN_CHANGED,), void=str(member["id"]).encode())


def on_leave(msg: m.Leave, principal: Principal | None, *, store: Store, draining: set[str]) -> Outcome:
    """Drain a member (`astraflow leave`): no new tasks; it finishes or returns its leases and says Bye."""
    refused = authz.leave_refusal(msg, principal)
    if refused is not None:
        return Outcome(m.Error(rid=msg.rid, code=refused[0], message=refused[1]))
    member = store.member(msg.member_id)
    if member is None or member["status"] != "alive":
        return Outcome(
            m.Error(rid=msg.rid, code="unknown_member", message=f"no live member {msg.member_id!r}")
        )
    draining.add(member["id"])
    store.add_event("member_draining", member["id"])
    _log.info("member %s asked to leave; draining it", member["id"])
    return Outcome(m.Ack(rid=msg.rid, detail="draining"), (Event.RUN_CHANGED,))

"""The controller's rules of who may say what: membership, roles, next versions and steps, task quotas.

Every rule here holds with authentication off too (principal None): a trainer must be the policy's
one live trainer, versions and steps must be the next ones, a worker holds at most its slots. With
a principal (the CURVE key that sent the frame) the member's id, role and policy must also be the
key's. A refusal is a (code, message) pair the controller answers as an Error; docs/protocol.md
lists the codes.
"""

from __future__ import annotations

import time
from typing import Any

from astraflow.protocol import messages as m
from astraflow.state import members, versions
from astraflow.state.batches import batch_recorded
from astraflow.state.store import Store
from astraflow.state.tasks import leases_held
from astraflow.transport.principal import Principal

Refusal = tuple[str, str]
"""(error code, message for people)."""

ROLES = ("raas", "trainer", "observer")
MAX_ID = 255
"""Longest member id (a ZeroMQ routing id is at most 255 bytes)."""
MAX_FIELD = 128
"""Longest stored free-form Hello field (region, hardware, host, policy names)."""
MAX_POLICIES = 32
"""Most policies one Hello may list."""
MAX_MEMBERS = 16384
"""Most member rows at once; beyond this a new id is refused until dead ones are pruned."""

_TRAINER_MSGS = (m.BatchRequest, m.VersionPublished)
_WORKER_MSGS = (m.TaskRequest, m.TaskResult, m.TaskResults)


def cap_hello(msg: m.Hello) -> m.Hello:
    """The Hello with its free-form fields cut to what the controller stores and logs."""
    return m.Hello(
        rid=msg.rid,
        member_id=msg.member_id,
        role=msg.role[:16],
        protocol=msg.protocol,
        policies=[p[:MAX_FIELD] for p in msg.policies[:MAX_POLICIES]],
        region=msg.region[:MAX_FIELD],
        hardware=msg.hardware[:MAX_FIELD],
        slots=max(0, min(msg.slots, 1 << 20)),
        pid=max(0, min(msg.pid, 1 << 31)),
        host=msg.host[:MAX_FIELD],
    )


def _recent(member: dict[str, Any], now: float, timeout_s: float) -> bool:
    return member["status"] == "alive" and (member["last_seen"] or 0.0) >= now - timeout_s


def hello_refusal(
    store: Store,
    msg: m.Hello,
    principal: Principal | None,
    *,
    policies: list[str],
    member_timeout_s: float,
    now: float | None = None,
) -> Refusal | None:
    """Why this Hello may not join (None: it may): `policies` are the run's policy names,
    `member_timeout_s` how long a silent member still holds its id. The Hello must already be capped."""
    t = time.time() if now is None else now
    return (
        _shape_refusal(msg, policies)
        or _key_refusal(msg, principal)
        or _membership_refusal(store, msg, t, member_timeout_s)
    )


def _shape_refusal(msg: m.Hello, policies: list[str]) -> Refusal | None:
    """What the Hello alone gets wrong: its id's length, its role, the policies it names."""
    if len(msg.member_id.encode()) > MAX_ID or not msg.member_id:
        return "bad_identity", f"a member id is 1 to {MAX_ID} bytes"
    if msg.role not in ROLES:
        return "bad_role", f"unknown role {msg.role!r}"
    unknown = [p for p in msg.policies if p not in policies]
    if unknown:
        return "unknown_policy", f"no policy {unknown[0]!r} in this run; policies: {policies}"
    if msg.role == "trainer" and len(msg.policies) != 1:
        return "bad_role", "a trainer trains exactly one policy"
    return None


def _key_refusal(msg: m.Hello, principal: Principal | None) -> Refusal | None:
    """With authentication on: the id, role and (a trainer's) policy must be the key's."""
    if principal is None:
        return None
    if principal.name != msg.member_id:
        return "bad_identity", f"this key belongs to member {principal.name!r}"
    if principal.role != msg.role:
        return "not_authorized", f"this key is for role {principal.role!r}, not {msg.role!r}"
    if msg.role == "trainer" and msg.policies != [principal.policy]:
        return "not_authorized", f"this key may train policy {principal.policy!r} only"
    return None


def _membership_refusal(store: Store, msg: m.Hello, t: float, timeout: float) -> Refusal | None:
    """What the members already joined forbid: another live process under this id, a full member
    table, another live trainer of the policy."""
    prev = store.member(msg.member_id)
    if (
        prev is not None
        and _recent(prev, t, timeout)
        and (prev["pid"] != msg.pid or prev["host"] != msg.host)
    ):
        # another process under a live id: it would take the live one's leases
        return (
            "member_id_in_use",
            f"member {msg.member_id!r} is alive (pid {prev['pid']} on {prev['host']!r}); "
            f"retry once it left or fell silent for {timeout:g}s",
        )
    if prev is None and members.member_count(store) >= MAX_MEMBERS:
        return "too_many_members", f"{MAX_MEMBERS} members are registered; retry later"
    if msg.role != "trainer":
        return None
    for other in store.members("alive"):
        if (
            other["id"] != msg.member_id
            and other["role"] == "trainer"
            and msg.policies[0] in other["policies"]
            and _recent(other, t, timeout)
        ):
            return (
                "trainer_taken",
                f"policy {msg.policies[0]!r} already has a live trainer ({other['id']!r}); "
                f"retry once it left or fell silent for {timeout:g}s",
            )
    return None


def message_refusal(member: dict[str, Any], msg: m.Msg, principal: Principal | None) -> Refusal | None:
    """Whether this member (and key) may send this message at all."""
    if principal is not None and principal.name != member["id"]:
        return "bad_identity", f"this key belongs to member {principal.name!r}"
    if isinstance(msg, _TRAINER_MSGS):
        policy = msg.policy
        if member["role"] != "trainer" or policy not in member["policies"]:
            return "not_authorized", f"only policy {policy!r}'s trainer may send {type(msg).__name__}"
        if principal is not None and (principal.role != "trainer" or principal.policy != policy):
            return "not_authorized", f"this key may not act for policy {policy!r}"
    if isinstance(msg, _WORKER_MSGS):
        if member["role"] != "raas" or (principal is not None and principal.role != "raas"):
            return "not_authorized", f"only rollout workers send {type(msg).__name__}"
    return None


def leave_refusal(msg: m.Leave, principal: Principal | None) -> Refusal | None:
    """Who may drain a member: anyone without authentication; with it an operator key or the member itself."""
    if principal is None or principal.role == "operator" or principal.name == msg.member_id:
        return None
    return "not_authorized", "draining a member needs an operator key or the member's own"


def control_refusal(principal: Principal | None) -> Refusal | None:
    """Who may pause, resume or stop the run: anyone without authentication (the controller then binds
    loopback only unless --insecure); with it an operator key only (observer keys read status)."""
    if principal is None or principal.role == "operator":
        return None
    return "not_authorized", "pausing, resuming or stopping the run needs an operator key"


def version_refusal(store: Store, msg: m.VersionPublished) -> Refusal | None:
    """A version must be the policy's next one (for a step whose batch was taken), or a known one re-announced."""
    known = versions.version_step(store, msg.policy, msg.version)
    if known is not None:
        if known != msg.step:
            return "bad_version", f"version {msg.version} was recorded for step {known}"
        return None
    pol = store.policy(msg.policy)
    want_v, want_s = int(pol["version"]) + 1, int(pol["step"]) + 1
    if msg.version != want_v or msg.step != want_s:
        return (
            "bad_version",
            f"the next version of {msg.policy!r} is {want_v} at step {want_s}, "
            f"not {msg.version} at step {msg.step}",
        )
    if not batch_recorded(store, msg.policy, msg.step):
        return "bad_version", f"step {msg.step} of {msg.policy!r} has not taken its batch"
    return None


def batch_refusal(store: Store, policy: str, step: int) -> Refusal | None:
    """A batch request must be for a recorded step (resume), the next one after the policy's last
    version, or the one after that once the next step's batch is taken: a trainer may train on while
    it publishes that step's version in the background (one version in flight at most)."""
    if batch_recorded(store, policy, step):
        return None
    want = int(store.policy(policy)["step"]) + 1
    ahead = step == want + 1 and batch_recorded(store, policy, want)
    if step != want and not ahead:
        return "bad_step", f"the next batch of {policy!r} is step {want}, not {step}"
    return None


def task_quota(
    store: Store, member: dict[str, Any], asked: int, *, default_slots: int, max_slots: int
) -> int:
    """Tasks a worker may be leased now: its declared slots (`default_slots`, `rollout.slots`, when it
    declared none; capped at `max_slots`, `controller.max_member_slots`) minus the leases it holds."""
    slots = int(member["slots"] or 0) or default_slots
    slots = min(slots, max_slots)
    held = leases_held(store, member["id"])
    return max(0, min(asked, slots - held))


def prune_members(store: Store, now: float, forget_after_s: float) -> list[str]:
    """Delete dead and departed members last seen more than forget_after_s ago; returns their ids."""
    return members.delete_departed(store, now - forget_after_s)

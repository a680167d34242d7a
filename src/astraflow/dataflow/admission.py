"""Staleness-aware admission: produce only samples that can still be trained on.

Why (B = batch size in sequences, S = max_staleness, versions: the weights after step k are
version k, and step k trains on version k-1):

A sample generated under version v may be consumed by steps up to v + S + 1. When it is admitted,
`outstanding` sequences (buffered + in flight + queued) are ahead of it, and `c` steps have already
taken their batches, so it is consumed at about step c + floor(outstanding / B) + 1. The bound
holds whenever

    floor(outstanding / B) <= S   and   v >= c + floor(outstanding / B) - S.

The first condition is the production cap `outstanding < (S + 1) * B`: more queued work than
S + 1 batches could only be trained on by weights more than S versions newer than today's, so it
would expire. The second is the lease rule: a worker is leased tasks only while the version it
has loaded is at least `target + floor((ahead + k - 1) / B) - S`, where ahead = buffered + in-flight
sequences (the queued tasks behind the one being leased do not count), k the sequences the task adds
(so its last sequence is within the bound too), and target = max(published version, steps already taken)
(a step that took its batch but has not published yet still moves the goal post: its weights will
be the ones the next batch trains on). With S = 0 this is synchronous RL: one batch of work is
admitted, nothing more until the trainer took it, and nothing is leased again until the new
version is published and loaded.

What it does not cover: a result can still arrive late (slow worker, lease expiry), and filters
can drop groups so the queue refills; the buffer's staleness check at batch time stays the
final guard. Sequences per task are estimated as group_size per role mapped to the policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from astraflow.state.store import Store


@dataclass(frozen=True)
class PolicyLimits:
    """What admission needs to know of one policy."""

    batch_size: int
    """Sequences per batch (batch_prompts * group_size)."""
    max_staleness: int
    """S of the policy."""


class Admission:
    """Caps queued + in-flight + buffered work per policy and gates leases on loaded versions."""

    def __init__(self, store: Store, limits: dict[str, PolicyLimits]) -> None:
        self.store = store
        self.limits = limits

    @staticmethod
    def sequences_per_task(roles: dict[str, str], group_size: int) -> dict[str, int]:
        """Expected sequences a task yields per policy."""
        out: dict[str, int] = {}
        for pol in roles.values():
            out[pol] = out.get(pol, 0) + group_size
        return out

    def _sequences(self, task_statuses: tuple[str, ...]) -> dict[str, int]:
        """Per policy: buffered trajectories + expected sequences of tasks in these statuses."""
        out = dict.fromkeys(self.limits, 0)
        for r in self.store.query(
            "SELECT policy, COUNT(*) AS n FROM trajectories WHERE status = 'buffered' GROUP BY policy"
        ):
            if r["policy"] in out:
                out[r["policy"]] += int(r["n"])
        marks = ",".join("?" for _ in task_statuses)
        for r in self.store.query(
            f"SELECT roles, group_size, COUNT(*) AS n FROM tasks WHERE status IN ({marks}) GROUP BY roles, group_size",
            task_statuses,
        ):
            for pol, k in self.sequences_per_task(json.loads(r["roles"]), int(r["group_size"])).items():
                if pol in out:
                    out[pol] += k * int(r["n"])
        return out

    def outstanding(self) -> dict[str, int]:
        """Per policy: buffered trajectories + expected sequences of queued and leased tasks."""
        return self._sequences(("queued", "leased"))

    def outstanding_groups(self) -> dict[str, int]:
        """Per policy, in groups (prompts): tasks queued or leased + tasks with buffered trajectories."""
        out = dict.fromkeys(self.limits, 0)
        for r in self.store.query(
            "SELECT policy, COUNT(DISTINCT task_id) AS n FROM trajectories WHERE status = 'buffered' GROUP BY policy"
        ):
            if r["policy"] in out:
                out[r["policy"]] += int(r["n"])
        for r in self.store.query(
            "SELECT roles, COUNT(*) AS n FROM tasks WHERE status IN ('queued', 'leased') GROUP BY roles"
        ):
            for pol in set(json.loads(r["roles"]).values()):
                if pol in out:
                    out[pol] += int(r["n"])
        return out

    def cap(self, policy: str) -> int:
        """Most outstanding sequences allowed: (S + 1) * B."""
        lim = self.limits[policy]
        return (lim.max_staleness + 1) * lim.batch_size

    def tasks_to_admit(self, roles: dict[str, str], group_size: int) -> int:
        """How many more tasks of this shape may be queued now (every policy they feed must have room)."""
        per = self.sequences_per_task(roles, group_size)
        out = self.outstanding()
        room: int | None = None
        for pol, k in per.items():
            if pol not in self.limits or k <= 0:
                continue
            free = self.cap(pol) - out[pol]
            # whole tasks that fit under the cap; rounding up would overshoot it by up to a group, and
            # that overshoot is consumed a version too late (it expired under replay's odd batch sizes).
            # With nothing outstanding, one task always goes, so a cap smaller than a group cannot stall.
            n = max(0, free) // k
            if n == 0 and out[pol] == 0:
                n = 1
            room = n if room is None else min(room, n)
        return room or 0

    def target_version(self, policy: str) -> int:
        """max(published version, steps whose batch was taken): the version the next batch trains on at least."""
        row = self.store.query("SELECT version FROM policies WHERE name = ?", (policy,))
        published = int(row[0]["version"]) if row else 0
        taken = int(
            self.store.scalar("SELECT COALESCE(MAX(step), 0) FROM batches WHERE policy = ?", (policy,))
        )
        return max(published, taken)

    def ahead(self, policy: str) -> int:
        """Sequences that will be consumed before a task leased now: buffered + in flight."""
        return self._sequences(("leased",)).get(policy, 0)

    def may_lease(
        self, loaded: dict[str, int], policies: Iterable[str], task_sequences: dict[str, int] | None = None
    ) -> bool:
        """True if the worker's loaded version v of every policy satisfies
        v >= target + floor((ahead + k - 1) / B) - S, with k the sequences this task adds (unknown
        loaded counts as 0): the task's last sequence is still consumed within the bound. Counting k
        matters when B is not a multiple of the group size (replay makes a batch's fresh part odd)."""
        for pol in policies:
            if pol not in self.limits:
                continue
            lim = self.limits[pol]
            k = max(1, (task_sequences or {}).get(pol, 1))
            need = self.target_version(pol) + (self.ahead(pol) + k - 1) // lim.batch_size - lim.max_staleness
            if loaded.get(pol, 0) < need:
                return False
        return True

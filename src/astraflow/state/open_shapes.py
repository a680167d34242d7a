"""Open tasks counted per shape, read once and then kept by the ledger's own writes.

A task request asks the store how many tasks of each shape (role map, group size, read-only
policies) are queued or leased up to four times: the refill's production cap (sequences and groups
outstanding), whether any queued shape may be leased, and the work ahead of the lease. Inside
`OpenShapes.kept()` the first of those questions reads one GROUP BY over the open tasks (by status
too) when the counts are not known, and the ledger's writes (tasks queued, leased, completed) keep
them as the store has them, across calls: the next request asks the store nothing. Any other change
of a task's status or shape (a failure, an expiry, a lease given back, a read-only list) drops the
counts, and so does a rollback: the next question reads the store again. Outside `kept()` every
question reads the store.

What it does not cover: a statement that changes the tasks table without the ledger would not be
seen; the controller writes tasks only through the ledger (state/ledger.py), and a retention pass
deletes only done tasks (state/tasks.py), which are not counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from astraflow.state.store import Store
from astraflow.state.task_json import parsed

OPEN = ("queued", "leased")
"""The statuses counted."""

Key = tuple[str, str, int, str]
"""(status, role map as stored, group size, read-only policies as stored)."""

_kept: dict[int, OpenShapes] = {}
"""id(store) -> its counts, while a kept span is open."""


class OpenShapes:
    """One store's open tasks per (status, role map, group size, read-only policies)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.counts: dict[Key, int] | None = None
        """Read when first asked inside `kept()`, then kept by `add`; None until then, and after a
        change it does not follow."""
        self.active = False
        store.on_rollback.append(self.forget)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """A span (one lease call) in which the counts are answered from memory (read first if not
        known); nested spans join the outer one."""
        if self.active:
            yield
            return
        self.active = True
        _kept[id(self.store)] = self
        try:
            yield
        finally:
            self.active = False
            _kept.pop(id(self.store), None)

    def forget(self) -> None:
        """The tasks changed in a way the counts do not follow: read them again when next asked."""
        self.counts = None

    def read(self) -> dict[Key, int]:
        """The counts (one GROUP BY when not kept)."""
        if self.counts is None:
            self.counts = {
                (r[0], r[1], int(r[2]), r[3] or "[]"): int(r[4])
                for r in self.store.query(
                    "SELECT status, roles, group_size, read_only, COUNT(*) FROM tasks "
                    "WHERE status IN ('queued', 'leased') GROUP BY status, roles, group_size, read_only"
                )
            }
        return self.counts

    def add(self, key: Key, n: int) -> None:
        """n tasks of this status and shape more (a negative n: fewer), when the counts are known."""
        if self.counts is None:
            return
        left = self.counts.get(key, 0) + n
        if left:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)


def kept_for(store: Store, statuses: tuple[str, ...]) -> OpenShapes | None:
    """The store's kept counts when a span is open and every status asked for is counted."""
    shapes = _kept.get(id(store))
    if shapes is None or shapes.store is not store or not set(statuses) <= set(OPEN):
        return None
    return shapes


def task_shapes(
    shapes: OpenShapes, statuses: tuple[str, ...]
) -> list[tuple[dict[str, str], int, list[str], int]]:
    """`tasks.task_shapes` from the kept counts, in the GROUP BY's order."""
    per: dict[tuple[str, int, str], int] = {}
    for (status, roles, size, ro), n in shapes.read().items():
        if status in statuses:
            per[(roles, size, ro)] = per.get((roles, size, ro), 0) + n
    return [(parsed(roles), size, parsed(ro), n) for (roles, size, ro), n in sorted(per.items())]


def open_task_roles(shapes: OpenShapes) -> list[tuple[dict[str, str], list[str], int]]:
    """`tasks.open_task_roles` from the kept counts, in the GROUP BY's order."""
    per: dict[tuple[str, str], int] = {}
    for (_status, roles, _size, ro), n in shapes.read().items():
        per[(roles, ro)] = per.get((roles, ro), 0) + n
    return [(parsed(roles), parsed(ro), n) for (roles, ro), n in sorted(per.items())]

"""The task ledger: every prompt's group is a task that is queued, leased, and done exactly once.

A lease carries an epoch that grows on every lease. A result is accepted only if it echoes the
task's current epoch and comes from the lease's owner, so a worker that lost its lease (expired,
died, left) cannot complete a task someone else now holds; a second result for a done task is a
duplicate. A lapsed lease that nobody took over yet still accepts its owner's late result: the
work is done, and throwing it away would only make someone redo it.

Over 400 lines because it is the one keeper of a task's states: each transition (queue, lease,
complete, expire, fail, retire) comes in a one-task and a one-statement-per-message form, and they
must read the same rows the same way; the SQL itself is in state/tasks.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from astraflow.state import tasks
from astraflow.state.open_shapes import OpenShapes
from astraflow.state.store import Store
from astraflow.state.task_json import parsed as _json
from astraflow.state.task_json import sample_of, sorted_dumps

LEASE_PAGE = 64
"""Queued tasks a lease reads per query after its first (which reads the n asked for)."""
LEASED_KEPT = 20_000
"""Leased tasks a ledger keeps as rows at most (past it, it starts again: `get_many` reads the rest)."""
KEPT_SAMPLE_CHARS = 4096
"""A leased task whose stored sample is longer is not kept (its row is read again): the kept rows
hold their samples' text while the tasks are in flight."""
IDS_PER_STATEMENT = 500
"""Task ids one statement names at most (SQLite's limit on bound parameters is 999 in old builds)."""


@dataclass
class TaskRow:
    """One task of the ledger as the controller sees it."""

    id: int
    prompt_key: str
    sample_json: str
    """The task's sample as stored (JSON); `sample` parses it when asked (only a lease needs it)."""
    roles: dict[str, str]
    group_size: int
    status: str
    owner: str
    epoch: int
    lease_expiry: float
    attempts: int
    read_only: list[str] = field(default_factory=list)
    """Policies this task does not feed (decided at admission): their sequences are not kept."""

    @cached_property
    def sample(self) -> dict[str, Any]:
        """The task's sample (parsed from `sample_json` once)."""
        return sample_of(self.sample_json)

    @property
    def policies(self) -> list[str]:
        """Distinct policies this task produces sequences for, in role order."""
        return list(dict.fromkeys(self.roles.values()))


def _row(r: Any) -> TaskRow:
    return TaskRow(
        id=r["id"],
        prompt_key=r["prompt_key"],
        sample_json=r["sample"],
        roles=_json(r["roles"]),
        group_size=r["group_size"],
        status=r["status"],
        owner=r["owner"],
        epoch=r["epoch"],
        lease_expiry=r["lease_expiry"],
        attempts=r["attempts"],
        read_only=_json(r["read_only"] or "[]"),
    )


def _kept_copy(task: TaskRow) -> TaskRow:
    """A copy of a leased row to keep: the caller's row goes on to hold the parsed sample its grant
    needs (`sample`), the kept one only the sample's text (a field-by-field copy of the instance,
    about 1 µs where `dataclasses.replace` took several)."""
    kept = object.__new__(TaskRow)
    kept.__dict__.update(task.__dict__)
    kept.__dict__.pop("sample", None)
    return kept


_QUEUED_PAGE = (
    "SELECT id, prompt_key, sample, roles, group_size, owner, epoch, lease_expiry, attempts, read_only "
    "FROM tasks WHERE status = 'queued' AND id > ? ORDER BY id LIMIT ?"
)
"""A page of the queue, oldest first, as the columns of a TaskRow (in its fields' order)."""


def _chunks(ids: Sequence[int]) -> Iterable[Sequence[int]]:
    """`ids` in runs of at most IDS_PER_STATEMENT."""
    for i in range(0, len(ids), IDS_PER_STATEMENT):
        yield ids[i : i + IDS_PER_STATEMENT]


class Ledger:
    """Queued / leased / done / failed tasks in the state store."""

    def __init__(
        self,
        store: Store,
        *,
        lease_timeout_s: float = 120.0,
        max_attempts: int = 5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.lease_timeout_s = lease_timeout_s
        self.max_attempts = max_attempts
        self.clock = clock
        self._done: int | None = None
        """Done tasks (retired ones included): counted once, then kept by `complete` (a done task
        never changes status again, and a retention pass moves it to the retired count); None after a
        rollback, so the next `counts` reads the store. Counting them each step scanned every done
        task of the run."""
        store.on_rollback.append(self._forget_done)
        self.shapes = OpenShapes(store)
        """Open tasks per shape, kept by this ledger's writes (state/open_shapes.py)."""
        self._leased: dict[int, tuple[TaskRow, float]] = {}
        """Tasks this ledger leased, as their rows are now, with the time of the lease (the row's
        `updated` while it is leased): `get_many` hands them to the results that come back without
        reading the store (a results message read its tasks' rows, about 2% of the live controller
        at the quickstart's shape). A heartbeat's renewal of named tasks moves their expiry as its
        UPDATE does; every other write of this ledger that changes one drops it (an expiry drops
        those it ends), one that changes a member's leases (given back, released, all renewed) drops
        them all, and so does a rollback; the controller is the only writer. Each tick's expiry that
        ends none changes nothing here."""
        store.on_rollback.append(self._leased.clear)

    def _forget_done(self) -> None:
        self._done = None

    def enqueue(
        self,
        prompt_key: str,
        sample: dict[str, Any],
        roles: dict[str, str],
        group_size: int,
        read_only: Iterable[str] = (),
    ) -> int:
        """Queue one task (not feeding the `read_only` policies); returns its id."""
        now = self.clock()
        roles_json, ro = json.dumps(roles), json.dumps(sorted(set(read_only)))
        with self.store.write() as c:
            cur = c.execute(
                "INSERT INTO tasks (prompt_key, sample, roles, group_size, status, owner, epoch, lease_expiry, "
                "attempts, error, created, updated, read_only) VALUES (?, ?, ?, ?, 'queued', '', 0, 0, 0, '', ?, ?, ?)",
                (prompt_key, json.dumps(sample, sort_keys=True), roles_json, group_size, now, now, ro),
            )
            self.shapes.add(("queued", roles_json, group_size, ro), 1)
            return int(cur.lastrowid or 0)

    def enqueue_many(
        self,
        tasks: Sequence[tuple[str, dict[str, Any], Iterable[str]]],
        roles: dict[str, str],
        group_size: int,
    ) -> None:
        """Queue tasks of one role map and group size in one statement: (prompt key, sample, read-only
        policies) each, in order (their ids follow that order)."""
        if not tasks:
            return
        now = self.clock()
        roles_json = json.dumps(roles)
        dumps = sorted_dumps()
        skips: dict[tuple[str, ...], str] = {}
        per: dict[str, int] = {}
        rows = []
        for key, sample, read_only in tasks:
            skip = tuple(sorted(set(read_only)))
            ro = skips.get(skip)
            if ro is None:
                ro = skips[skip] = json.dumps(list(skip))
            per[ro] = per.get(ro, 0) + 1
            rows.append((key, dumps(sample), roles_json, group_size, now, now, ro))
        with self.store.write() as c:
            c.executemany(
                "INSERT INTO tasks (prompt_key, sample, roles, group_size, status, owner, epoch, lease_expiry, "
                "attempts, error, created, updated, read_only) VALUES (?, ?, ?, ?, 'queued', '', 0, 0, 0, '', ?, ?, ?)",
                rows,
            )
            for ro, k in per.items():
                self.shapes.add(("queued", roles_json, group_size, ro), k)

    def get(self, task_id: int) -> TaskRow | None:
        """One task, or None."""
        rows = self.store.query("SELECT * FROM tasks WHERE id = ?", (task_id,))
        return _row(rows[0]) if rows else None

    def get_many(self, task_ids: Iterable[int]) -> dict[int, TaskRow]:
        """Task id -> task, for those of `task_ids` that exist: the ones this ledger leased as it
        keeps them, the others in one query."""
        out: dict[int, TaskRow] = {}
        missing: list[int] = []
        for tid in set(task_ids):
            kept = self._leased.get(tid)
            if kept is None:
                missing.append(tid)
            else:
                out[tid] = kept[0]
        for part in _chunks(sorted(missing)):
            marks = ",".join("?" * len(part))
            for r in self.store.query(f"SELECT * FROM tasks WHERE id IN ({marks})", tuple(part)):
                out[int(r["id"])] = _row(r)
        return out

    def lease(
        self,
        member_id: str,
        n: int,
        now: float | None = None,
        accept: Callable[[TaskRow], bool] | None = None,
    ) -> list[TaskRow]:
        """Lease up to n queued tasks (oldest first, those `accept` allows) to a member: epoch += 1
        (one UPDATE for all of them)."""
        if n <= 0:
            return []
        t = self.clock() if now is None else now
        expiry = t + self.lease_timeout_s
        out: list[TaskRow] = []
        shapes: dict[tuple[str, int, str], int] = {}
        """(role map, group size, read-only policies) as stored -> tasks of that shape leased."""
        after = 0
        with self.store.write() as c:
            # Read the queue a page at a time (oldest first): a request for n tasks parses about n
            # rows, not the whole queue. The leases are written after the last page (a later page
            # starts past the ids already taken, so it cannot see them queued again). Rows come as
            # tuples of the columns a TaskRow holds (no sqlite3.Row, no column looked up by name).
            cur = c.cursor()
            cur.row_factory = None
            # the first page is the n asked for (the usual lease takes every row it reads: a request
            # for one task read and parsed 64 rows); one that refuses some reads on by LEASE_PAGE rows
            limit = n
            while len(out) < n:
                page = cur.execute(_QUEUED_PAGE, (after, limit)).fetchall()
                limit = max(n, LEASE_PAGE)
                if not page:
                    break
                after = int(page[-1][0])
                for tid, key, sample, roles, size, owner, epoch, expires, attempts, ro in page:
                    task = TaskRow(
                        tid, key, sample, _json(roles), size, "queued", owner, epoch, expires, attempts,
                        _json(ro or "[]"),
                    )  # fmt: skip
                    if accept is not None and not accept(task):
                        continue
                    task.epoch += 1
                    task.status, task.owner, task.lease_expiry = "leased", member_id, expiry
                    out.append(task)
                    shape = (roles, size, ro or "[]")
                    shapes[shape] = shapes.get(shape, 0) + 1
                    if len(out) >= n:
                        break
            for part in _chunks([task.id for task in out]):
                # every task of the page was read queued in this transaction: its epoch grows by one
                c.execute(
                    "UPDATE tasks SET status = 'leased', owner = ?, epoch = epoch + 1, lease_expiry = ?, "
                    f"updated = ?, leased_at = ? WHERE id IN ({','.join('?' * len(part))})",
                    (member_id, expiry, t, t, *part),
                )
            for (roles, size, ro), k in shapes.items():
                self.shapes.add(("queued", roles, size, ro), -k)
                self.shapes.add(("leased", roles, size, ro), k)
            if len(self._leased) > LEASED_KEPT:
                self._leased.clear()
            for task in out:
                if len(task.sample_json) <= KEPT_SAMPLE_CHARS:
                    self._leased[task.id] = (_kept_copy(task), t)
        return out

    def set_read_only(self, task: TaskRow, read_only: Iterable[str]) -> None:
        """Record the policies a leased task no longer feeds (their budget was taken since it was queued)."""
        task.read_only = sorted(set(read_only))
        self.shapes.forget()  # a leased task's shape changes: the kept counts do not follow it
        kept = self._leased.get(task.id)
        if kept is not None and kept[0] is not task:
            kept[0].read_only = list(task.read_only)
        with self.store.write() as c:
            c.execute("UPDATE tasks SET read_only = ? WHERE id = ?", (json.dumps(task.read_only), task.id))

    def complete(self, task_id: int, epoch: int, owner: str) -> str:
        """Validate a result's lease and mark the task done: accepted | duplicate | stale_epoch | unknown_task."""
        now = self.clock()
        self._leased.pop(task_id, None)
        with self.store.write() as c:
            r = c.execute(
                "SELECT status, epoch, owner, roles, group_size, read_only FROM tasks WHERE id = ?",
                (task_id,),
            ).fetchone()
            if r is None:
                return "unknown_task"
            if r["status"] == "done":
                return "duplicate"
            if (
                r["status"] not in ("leased", "queued")
                or r["epoch"] != epoch
                or r["owner"] != owner
                or epoch == 0
            ):
                return "stale_epoch"
            c.execute(
                "UPDATE tasks SET status = 'done', lease_expiry = 0, updated = ? WHERE id = ?", (now, task_id)
            )
            self.shapes.add((r["status"], r["roles"], int(r["group_size"]), r["read_only"] or "[]"), -1)
            if self._done is not None:
                self._done += 1
            return "accepted"

    def complete_many(self, results: Sequence[tuple[int, int]], owner: str | Sequence[str]) -> list[str]:
        """`complete` for the (task id, epoch) results of one owner's message (or each result's own
        owner, in a list), in order, with one read and one UPDATE: a task named twice is accepted at
        most once (a later one is a duplicate)."""
        now = self.clock()
        out: list[str] = []
        for tid, _epoch in results:
            self._leased.pop(tid, None)
        with self.store.write() as c:
            rows: dict[int, tuple[str, int, str]] = {}
            shapes: dict[int, tuple[str, str, int, str]] = {}
            """Task id -> its open shape (status, roles, group size, read-only) as the counts key it."""
            for part in _chunks(sorted({tid for tid, _ in results})):
                for r in c.execute(
                    "SELECT id, status, epoch, owner, roles, group_size, read_only FROM tasks "
                    f"WHERE id IN ({','.join('?' * len(part))})",
                    tuple(part),
                ):
                    rows[int(r[0])] = (r[1], r[2], r[3])
                    shapes[int(r[0])] = (r[1], r[4], int(r[5]), r[6] or "[]")
            done: list[int] = []
            owners = [owner] * len(results) if isinstance(owner, str) else owner
            for (tid, epoch), who in zip(results, owners, strict=True):
                row = rows.get(tid)
                if row is None:
                    out.append("unknown_task")
                elif row[0] == "done":
                    out.append("duplicate")
                elif row[0] not in ("leased", "queued") or row[1] != epoch or row[2] != who or epoch == 0:
                    out.append("stale_epoch")
                else:
                    out.append("accepted")
                    done.append(tid)
                    rows[tid] = ("done", row[1], row[2])
            for part in _chunks(done):
                c.execute(
                    "UPDATE tasks SET status = 'done', lease_expiry = 0, updated = ? "
                    f"WHERE id IN ({','.join('?' * len(part))})",
                    (now, *part),
                )
            for tid in done:  # each was read leased or queued: one fewer open task of its shape
                self.shapes.add(shapes[tid], -1)
            if self._done is not None:
                self._done += len(done)
        return out

    def fail(self, task_id: int, epoch: int, owner: str | None = None, error: str = "") -> str:
        """A lease ended in an error: requeued | failed (after max_attempts) | duplicate | stale_epoch | unknown_task."""
        now = self.clock()
        self.shapes.forget()  # a status changes: the kept counts do not follow it
        self._leased.pop(task_id, None)
        with self.store.write() as c:
            r = c.execute(
                "SELECT status, epoch, owner, attempts FROM tasks WHERE id = ?", (task_id,)
            ).fetchone()
            if r is None:
                return "unknown_task"
            if r["status"] == "done":
                return "duplicate"
            if r["status"] != "leased" or r["epoch"] != epoch or (owner is not None and r["owner"] != owner):
                return "stale_epoch"
            return self._end_attempt(c, task_id, r["attempts"] + 1, now, error)

    def _end_attempt(self, c: Any, task_id: int, attempts: int, now: float, error: str) -> str:
        status = "failed" if attempts >= self.max_attempts else "queued"
        # The owner and epoch stay: a late result of this very lease is still accepted while queued.
        c.execute(
            "UPDATE tasks SET status = ?, attempts = ?, lease_expiry = 0, error = ?, updated = ? WHERE id = ?",
            (status, attempts, error[:2000], now, task_id),
        )
        return "failed" if status == "failed" else "requeued"

    def give_back(self, task_id: int, epoch: int, owner: str) -> bool:
        """Requeue one leased attempt without counting it (its failure was its worker's, not the task's)."""
        self.shapes.forget()  # a status changes: the kept counts do not follow it
        self._leased.pop(task_id, None)
        with self.store.write() as c:
            cur = c.execute(
                "UPDATE tasks SET status = 'queued', lease_expiry = 0, updated = ? "
                "WHERE id = ? AND status = 'leased' AND epoch = ? AND owner = ?",
                (self.clock(), task_id, epoch, owner),
            )
            return cur.rowcount > 0

    def give_back_lapsed(self, member_id: str, now: float) -> int:
        """Requeue a member's leases past their expiry without counting an attempt; returns how many."""
        self.shapes.forget()  # a status changes: the kept counts do not follow it
        with self.store.write() as c:
            cur = c.execute(
                "UPDATE tasks SET status = 'queued', lease_expiry = 0, updated = ? "
                "WHERE status = 'leased' AND owner = ? AND lease_expiry < ?",
                (now, member_id, now),
            )
            if cur.rowcount:
                self._leased.clear()
            return cur.rowcount

    def release_member(self, member_id: str) -> int:
        """Return every task leased to a member (dead or left) to the queue at once; returns how many."""
        now = self.clock()
        self.shapes.forget()  # a status changes: the kept counts do not follow it
        with self.store.write() as c:
            cur = c.execute(
                "UPDATE tasks SET status = 'queued', lease_expiry = 0, updated = ? WHERE status = 'leased' AND owner = ?",
                (now, member_id),
            )
            if cur.rowcount:
                self._leased.clear()
            return cur.rowcount

    def expire(self, now: float | None = None) -> int:
        """Requeue (or fail, after max_attempts) every lease past its expiry; returns how many ended."""
        t = self.clock() if now is None else now
        self.shapes.forget()  # a status changes: the kept counts do not follow it
        with self.store.write() as c:
            rows = c.execute(
                "SELECT id, attempts FROM tasks WHERE status = 'leased' AND lease_expiry < ?", (t,)
            ).fetchall()
            for r in rows:
                self._leased.pop(int(r["id"]), None)
                self._end_attempt(c, r["id"], r["attempts"] + 1, t, "lease expired")
            return len(rows)

    def renew(self, member_id: str, now: float | None = None) -> int:
        """Extend every lease of a member to now + lease_timeout (a heartbeat); returns how many."""
        t = self.clock() if now is None else now
        with self.store.write() as c:
            cur = c.execute(
                "UPDATE tasks SET lease_expiry = ? WHERE status = 'leased' AND owner = ?",
                (t + self.lease_timeout_s, member_id),
            )
            # the controller renews the tasks a heartbeat names (`renew_tasks`); finding this
            # member's kept rows would walk all of them
            if cur.rowcount:
                self._leased.clear()
            return cur.rowcount

    def renew_tasks(
        self, member_id: str, task_ids: Iterable[int], now: float | None = None, max_age_s: float = 0.0
    ) -> int:
        """Extend the member's leases on these tasks only (those it reports progress on); a lease
        older than max_age_s (0: no limit) is not extended, so no heartbeat keeps a task forever."""
        t = self.clock() if now is None else now
        ids = sorted({int(i) for i in task_ids})[:4096]
        if not ids:
            return 0
        marks = ",".join("?" for _ in ids)
        # `updated` is the lease's start while a task is leased (renewals leave it alone)
        oldest = t - max_age_s if max_age_s > 0 else float("-inf")
        expiry = t + self.lease_timeout_s
        for tid in ids:  # the kept rows as the statement below changes their rows (all are leased)
            kept = self._leased.get(tid)
            if kept is not None and kept[0].owner == member_id and kept[1] >= oldest:
                kept[0].lease_expiry = max(kept[0].lease_expiry, expiry)
        with self.store.write() as c:
            cur = c.execute(
                f"UPDATE tasks SET lease_expiry = MAX(lease_expiry, ?) WHERE status = 'leased' AND owner = ? "
                f"AND updated >= ? AND id IN ({marks})",
                (t + self.lease_timeout_s, member_id, oldest, *ids),
            )
            return cur.rowcount

    def counts(self) -> dict[str, int]:
        """Tasks per status: queued, leased, done, failed (zeros included; done counts retired ones)."""
        if self._done is None:
            self._done = tasks.done_count(self.store)
        out = {s: tasks.status_count(self.store, s) for s in ("queued", "leased")}
        return {**out, "done": self._done, "failed": tasks.status_count(self.store, "failed")}

    def open_tasks(self, statuses: Iterable[str] = ("queued", "leased")) -> list[TaskRow]:
        """Tasks in the given statuses (for admission's outstanding count)."""
        st = list(statuses)
        marks = ",".join("?" for _ in st)
        return [
            _row(r)
            for r in self.store.query(f"SELECT * FROM tasks WHERE status IN ({marks}) ORDER BY id", tuple(st))
        ]

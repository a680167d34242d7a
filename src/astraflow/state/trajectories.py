"""Trajectories in state.db: stored sequences of a policy, buffered until a batch consumes them.

Over 400 lines because every statement on the trajectories table is here, next to the invariants
those statements keep together: ids only grow, the buffer's floor, the counts per status the
writer keeps."""

from __future__ import annotations

import sqlite3
import weakref
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from astraflow.state import token_groups
from astraflow.state.store import Store

STATUSES = ("buffered", "consumed", "expired", "dropped")
_ANY_STATUS = "status IN ('buffered', 'consumed', 'expired', 'dropped')"
"""Every status (a query of every trajectory of a policy reads the table: no index starts with the
policy, migration 0010 dropped it, one index less to keep up on every insert and status change)."""
LEFT = "status IN ('expired', 'dropped')"
"""The condition of the status index (migration 0012: `(status, policy, task_id) WHERE status IN
('expired', 'dropped')`): only the trajectories that left the buffer untrained are in it, so storing
a sequence and marking it consumed change no index entry. A query of those statuses names it word for
word, so that SQLite uses the index (it does not infer it from `status = ?`)."""
BUFFERED = "id >= (SELECT COALESCE(MAX(first_id), 0) FROM buffer_floor) AND status = 'buffered'"
"""The buffered trajectories, read from the buffer's floor on: every buffered row has an id at least
the floor (`buffer_floor`, migration 0012), so a query of them reads the rows from there on in id
order (a primary-key range: the newest rows, a few steps of them) instead of a status index that
every stored and every consumed sequence would change. The writer raises the floor as batches
consume (`mark_consumed`) and lowers it when rows are buffered again (`rebuffered`)."""
_BUFFERED_ANY = "status = 'buffered'"
"""The buffered trajectories of a state.db without the floor (a reader of a file an older controller
writes: migration 0012 not applied yet)."""
_HAS_FLOOR: weakref.WeakKeyDictionary[Store, bool] = weakref.WeakKeyDictionary()


def _buffered(store: Store) -> str:
    """The condition of the buffered rows for this store: from the floor, or every row without one."""
    has = _HAS_FLOOR.get(store)
    if has is None:
        has = _HAS_FLOOR[store] = (
            store.scalar("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'buffer_floor'")
            is not None
        )
    return BUFFERED if has else _BUFFERED_ANY


def _marks(n: int) -> str:
    return ",".join("?" * n)  # a C-level join: a batch names 512 ids a step


def id_runs(ids: list[int]) -> list[tuple[int, int]]:
    """`ids` as runs of consecutive ids, (first, count) each, in order (a repeated or smaller id
    starts a run): a group's sequences have consecutive ids, so a batch is a few dozen runs."""
    if not ids:
        return []
    arr = np.asarray(ids, np.int64)
    starts = np.flatnonzero(np.diff(arr) != 1) + 1
    firsts = arr[np.concatenate(([0], starts))].tolist()
    counts = np.diff(np.concatenate(([0], starts, [len(arr)]))).tolist()
    return list(zip(firsts, counts, strict=True))


def _ids_json(ids: list[int]) -> str:
    """Ids as one JSON array parameter: a set-based statement of any size, no per-row round trip."""
    return "[" + ",".join(map(str, map(int, ids))) + "]"


REQUIRED = ("task_id", "policy", "prompt_key", "reward", "advantage", "length", "min_version", "arrival")
"""The columns every inserted trajectory row gives, in a row's order."""
OPTIONAL = ("status", "role", "group_key", "temperature", "top_p", "top_k")
"""The columns an inserted row may leave to their defaults (`DEFAULTS`), in a row's order after the
required ones: a row of a `Layout` gives the required columns, then the layout's optional ones."""
DEFAULTS: dict[str, Any] = {
    "status": "buffered",
    "role": "",
    "group_key": "",
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
}
"""The schema's default of each optional column (migrations 0001 and 0002): a row that leaves it out
stores exactly this value."""
Layout = tuple[str, ...]
"""The optional columns a run of rows gives (a subsequence of OPTIONAL)."""
FULL: Layout = OPTIONAL
"""Every column: rows of (task_id, policy, prompt_key, reward, advantage, length, min_version,
arrival, status, role, group_key, temperature, top_p, top_k)."""
ROWS_PER_STATEMENT = (64, 16)
"""Trajectory rows one execution of an INSERT carries, largest first (the rest one a time): an
execution of many rows costs SQLite and the driver less per row than one execution per row (about
2.7 -> 2.2 µs a row at 3 tokens), a few fixed sizes keep the prepared statements few, and 64 x 14
parameters stay under the 999 of old SQLite builds."""
_INSERTS: dict[tuple[Layout, int], str] = {}
"""(layout, rows an execution) -> the INSERT, built on first use (a run names a few layouts)."""


def _insert_sql(layout: Layout, size: int) -> str:
    sql = _INSERTS.get((layout, size))
    if sql is None:
        cols = REQUIRED + layout
        row = "(" + ", ".join("?" * len(cols)) + ")"
        sql = _INSERTS[(layout, size)] = f"INSERT INTO trajectories ({', '.join(cols)}) VALUES " + ",".join(
            [row] * size
        )
    return sql


def layout_of(defaults: dict[str, bool]) -> Layout:
    """The layout that gives every optional column not marked True (left to its default) in `defaults`."""
    return tuple(col for col in OPTIONAL if not defaults.get(col, False))


def _insert_rows(c: sqlite3.Connection, rows: list[tuple[Any, ...]], layout: Layout) -> None:
    """Insert trajectory rows of one layout in order: as many as fit in executions of
    ROWS_PER_STATEMENT rows, then one a time (each execution's parameters flattened in C: `chain`).
    A column the layout leaves out takes its default: fewer values bound a row (about 0.7 µs a row
    less for the eight of a row whose optional columns all hold their defaults, than for fourteen)."""
    done = 0
    for size in ROWS_PER_STATEMENT:
        n = (len(rows) - done) // size * size
        if n:
            c.executemany(
                _insert_sql(layout, size),
                [list(chain.from_iterable(rows[k : k + size])) for k in range(done, done + n, size)],
            )
            done += n
    if done < len(rows):
        c.executemany(_insert_sql(layout, 1), rows[done:])


_NAMED_ROLES: weakref.WeakKeyDictionary[Store, bool] = weakref.WeakKeyDictionary()
"""Store -> whether a trajectory with a named workflow role may be in it: read once, then set by
every insert that names one (`insert_runs` is the only writer of trajectory rows). A rolled-back
or deleted row may leave it True, which only costs a query that finds nothing."""


def _may_have_roles(store: Store) -> bool:
    known = _NAMED_ROLES.get(store)
    if known is None:
        known = store.scalar("SELECT 1 FROM trajectories WHERE role != '' LIMIT 1") is not None
        _NAMED_ROLES[store] = known
    return known


def max_trajectory_id(store: Store) -> int:
    """The newest trajectory id (0 when none): ids only grow, so it is a cheap arrival counter."""
    with store.write() as c:
        return int(c.execute("SELECT COALESCE(MAX(id), 0) FROM trajectories").fetchone()[0])


def insert_groups(
    store: Store,
    first_id: int,
    rows: list[tuple[Any, ...]],
    groups: list[tuple[Any, ...]],
) -> None:
    """`insert_runs` of rows that give every column (FULL)."""
    insert_runs(store, first_id, [(FULL, rows)], groups)


def insert_runs(
    store: Store,
    first_id: int,
    runs: list[tuple[Layout, list[tuple[Any, ...]]]],
    groups: list[tuple[Any, ...]],
) -> None:
    """Insert groups of trajectories whose ids are first_id, first_id + 1, ... in row order: runs of
    rows of one layout each (the required columns, then the layout's optional ones), in order, in a
    few executions of many rows each (ROWS_PER_STATEMENT), and each group's token_groups row
    (token_groups.group_row or joined_row) in one statement. Raises if SQLite gave other ids."""
    n = 0
    for layout, rows in runs:
        n += len(rows)
        if "role" in layout and any(map(itemgetter(len(REQUIRED) + layout.index("role")), rows)):
            _NAMED_ROLES[store] = True
    with store.write() as c:
        for layout, rows in runs:
            if rows:
                _insert_rows(c, rows, layout)
        last = int(c.execute("SELECT last_insert_rowid()").fetchone()[0])
        if last != first_id + n - 1:
            raise RuntimeError(f"trajectory ids {last - n + 1}..{last}, expected from {first_id}")
        token_groups.insert_groups(store, groups)
        _inserted_statuses(store, runs)


def _inserted_statuses(store: Store, runs: list[tuple[Layout, list[tuple[Any, ...]]]]) -> None:
    """Add the inserted rows of a kept status (a layout that gives the status: others are buffered)."""
    for layout, rows in runs:
        if "status" not in layout or not rows:
            continue
        at = len(REQUIRED) + layout.index("status")
        counted: dict[tuple[str, str], int] = {}
        for key in zip(map(itemgetter(1), rows), map(itemgetter(at), rows), strict=True):
            counted[key] = counted.get(key, 0) + 1
        for (policy, status), n in counted.items():
            status_changed(store, policy, status, n)


def count(store: Store, policy: str, status: str | None = None) -> int:
    """Trajectories of `policy` (in `status`, or ever stored)."""
    if status is None:
        return int(
            store.scalar(f"SELECT COUNT(*) FROM trajectories WHERE {_ANY_STATUS} AND policy = ?", (policy,))
        )
    if status == "buffered":
        return int(
            store.scalar(
                f"SELECT COUNT(*) FROM trajectories WHERE {_buffered(store)} AND policy = ?", (policy,)
            )
        )
    return _kept_count(store, policy, status)


KEPT = ("consumed", "expired", "dropped")
"""The statuses whose counts the writer keeps (_COUNTS)."""
_COUNTS: weakref.WeakKeyDictionary[Store, dict[tuple[str, str], int]] = weakref.WeakKeyDictionary()
"""The writer's store -> (policy, status) -> trajectories, for the statuses in KEPT: counted once, then
kept by the statements that change them (`status_changed`): an insert adds the rows it stores in
such a status (a post-rollout filter's dropped groups), `expire` and `mark_consumed` add what they
marked, a retention pass (state/archive.py) takes away what it deleted; `forget_batch`, `mark_dropped`
and a rollback forget them all (counted again when next asked). A count reads rows that grow with the
run: the consumed rows have no index (LEFT), so about a second at ten million rows, and every status
request asks for it; the expired and dropped rows are in the status index, but each step's metrics
row counted them all (15,000 expired rows after 800 steps of the bench at the quickstart's shape:
about 9% of the live controller's samples)."""


def _kept(store: Store) -> dict[tuple[str, str], int] | None:
    """The writer's kept counts (None for a read-only store: another process writes)."""
    if store.readonly:
        return None
    kept = _COUNTS.get(store)
    if kept is None:
        kept = _COUNTS[store] = {}
        store.on_rollback.append(kept.clear)
    return kept


def forget_counts(store: Store) -> None:
    """Count the kept statuses again when next asked (a change the kept counts do not follow)."""
    kept = _COUNTS.get(store)
    if kept is not None:
        kept.clear()


def status_changed(store: Store, policy: str, status: str, n: int) -> None:
    """`policy` has `n` more trajectories in `status` (fewer when negative: a retention pass deleted
    them); a count not kept (not read yet, or another status) stays unread."""
    kept = _COUNTS.get(store)
    if kept is not None and (policy, status) in kept:
        kept[(policy, status)] += n


def _kept_count(store: Store, policy: str, status: str) -> int:
    """Trajectories of `policy` in `status` (one of KEPT): kept by the writer (_COUNTS), else a read
    of the table (consumed) or of the status index (expired, dropped)."""
    kept = _kept(store)
    if kept is not None and (policy, status) in kept:
        return kept[(policy, status)]
    if status == "consumed":
        sql = "SELECT COUNT(*) FROM trajectories WHERE status = 'consumed' AND policy = ?"
        n = int(store.scalar(sql, (policy,)))
    elif status in KEPT:
        sql = f"SELECT COUNT(*) FROM trajectories WHERE {LEFT} AND status = ? AND policy = ?"
        n = int(store.scalar(sql, (status, policy)))
    else:
        raise ValueError(f"no trajectory status {status!r}")
    if kept is not None:
        kept[(policy, status)] = n
    return n


def status_counts(store: Store, policy: str) -> dict[str, int]:
    """Trajectories of `policy` per status (every status, 0 when none)."""
    out = {status: _kept_count(store, policy, status) for status in KEPT}
    out["buffered"] = count(store, policy, "buffered")
    return {status: out[status] for status in STATUSES}


def buffered_by_policy(store: Store) -> dict[str, int]:
    """Buffered trajectories per policy."""
    return {
        r["policy"]: int(r["n"])
        for r in store.query(
            f"SELECT policy, COUNT(*) AS n FROM trajectories WHERE {_buffered(store)} GROUP BY policy"
        )
    }


def buffered_groups_by_policy(store: Store) -> dict[str, int]:
    """Tasks with buffered trajectories, per policy."""
    return {
        r["policy"]: int(r["n"])
        for r in store.query(
            f"SELECT policy, COUNT(DISTINCT task_id) AS n FROM trajectories WHERE {_buffered(store)} "
            "GROUP BY policy"
        )
    }


RANGES_AT_MOST = 64
"""A set of ids in at most this many runs is read as id ranges (`role_rewards`), more as a list."""


def role_rewards(store: Store, ids: list[int]) -> list[tuple[str, float, int]]:
    """(role, mean reward, sequences) per workflow role among these trajectories (unnamed roles left out)."""
    if not ids or not _may_have_roles(store):
        return []  # a run whose workflows name no role (the usual case) reads no rows for it
    runs = id_runs(sorted(set(ids)))
    if len(runs) <= RANGES_AT_MOST:
        # a batch's ids are a few runs: a range each instead of an ephemeral table of 512 ids; either
        # way SQLite reads the rows in id order, so the means are the same to the float
        where = " OR ".join(["id BETWEEN ? AND ?"] * len(runs))
        params: tuple[int, ...] = tuple(x for first, n in runs for x in (first, first + n - 1))
    else:
        where, params = f"id IN ({_marks(len(ids))})", tuple(ids)
    return [
        (r["role"], float(r["reward"]), int(r["n"]))
        for r in store.query(
            f"SELECT role, AVG(reward) AS reward, COUNT(*) AS n FROM trajectories WHERE ({where}) "
            "AND role != '' GROUP BY role",
            params,
        )
    ]


def reward_rows(store: Store, ids: list[int]) -> list[tuple[float, int, int]]:
    """(reward, min_version, task_id) of each of these trajectories, in id order."""
    if not ids:
        return []
    return [
        (float(r["reward"]), int(r["min_version"]), int(r["task_id"]))
        for r in store.query(
            f"SELECT reward, min_version, task_id FROM trajectories WHERE id IN ({_marks(len(ids))}) ORDER BY id",
            tuple(ids),
        )
    ]


def token_bytes(store: Store, ids: list[int]) -> dict[int, int]:
    """Stored bytes of each trajectory's per-token arrays, read without loading them."""
    return {i: n * token_groups.TOKEN_BYTES for i, n in token_groups.token_counts(store, ids).items()}


def advantages(store: Store, ids: list[int]) -> dict[int, float]:
    """The stored advantage of each trajectory, read without its tokens."""
    unique = tuple(set(ids))
    if not unique:
        return {}
    rows = store.query(f"SELECT id, advantage FROM trajectories WHERE id IN ({_marks(len(unique))})", unique)
    return {int(r["id"]): float(r["advantage"]) for r in rows}


def buffered_items(store: Store, policy: str) -> list[sqlite3.Row]:
    """Rows (id, task_id, min_version, arrival, reward, advantage, length) of the buffered trajectories."""
    with store.write() as c:
        return c.execute(
            "SELECT id, task_id, min_version, arrival, reward, advantage, length FROM trajectories "
            f"WHERE {_buffered(store)} AND policy = ?",
            (policy,),
        ).fetchall()


def expire(store: Store, ids: list[int]) -> None:
    """Mark these buffered trajectories expired (too stale to train on); others are left as they are."""
    # `+status`: by the ids, not by walking the status index (as mark_consumed)
    where = "WHERE id IN (SELECT value FROM json_each(?)) AND +status = 'buffered'"
    with store.write() as c:
        js = _ids_json(ids)
        found = c.execute(
            f"SELECT policy, COUNT(*) FROM trajectories {where} GROUP BY policy", (js,)
        ).fetchall()
        c.execute(f"UPDATE trajectories SET status = 'expired' {where}", (js,))
        for policy, n in found:
            status_changed(store, policy, "expired", int(n))


_NEWEST = (
    "SELECT id, consumed_step FROM trajectories WHERE id >= ? AND policy = ? AND status = 'consumed' "
    "ORDER BY consumed_step DESC, arrival DESC LIMIT ?"
)


def newest_consumed(store: Store, policy: str, n: int, since: tuple[int, int] | None = None) -> list[int]:
    """Ids of the `n` most recently consumed trajectories of `policy` (replay candidates). `since`,
    (first id, step), says that every trajectory consumed at that step or later has an id >= first
    id (batches.consumed_since): the rows from that id on are read first, and the whole table only
    when what they hold may not be the newest n (the consumed rows have no index)."""
    with store.write() as c:
        if since is not None:
            rows = c.execute(_NEWEST, (since[0], policy, n)).fetchall()
            # a row left out (id < first id) was consumed before the step: it ranks below the n-th
            if len(rows) == n and int(rows[-1][1]) >= since[1]:
                return [r[0] for r in rows]
        return [r[0] for r in c.execute(_NEWEST, (0, policy, n)).fetchall()]


def mark_consumed(store: Store, policy: str, step: int, ids: list[int]) -> None:
    """Mark buffered trajectories of `policy` consumed by `step` (ids of another policy are left as they are).
    They are a batch's: its caller records that batch (state/batches.py) in the same transaction, and a
    retention pass finds the consumed rows through those records (state/archive.py); rows marked
    without one stay in state.db until a recorded batch holds a higher id."""
    with store.write() as c:
        # by id ranges: `+status` keeps SQLite from walking every buffered row through the status
        # index to test each against the ids (the plan it chose for `id IN (...) AND status = ?`)
        cur = c.executemany(
            "UPDATE trajectories SET status = 'consumed', consumed_step = ? "
            "WHERE id BETWEEN ? AND ? AND +status = 'buffered' AND policy = ?",
            [(step, first, first + n - 1, policy) for first, n in id_runs(ids)],
        )
        # the rows changed by every execution together
        status_changed(store, policy, "consumed", cur.rowcount)
        _raise_floor(c)


def _raise_floor(c: sqlite3.Connection) -> None:
    """Move the buffer's floor up to the oldest buffered trajectory (of any policy), or past the newest
    row when none is buffered: one read in id order from the floor to that row, so over a run each row
    is passed once (inside the caller's transaction)."""
    floor = int(c.execute("SELECT COALESCE(MAX(first_id), 0) FROM buffer_floor").fetchone()[0])
    row = c.execute(
        "SELECT id FROM trajectories WHERE id >= ? AND status = 'buffered' ORDER BY id LIMIT 1", (floor,)
    ).fetchone()
    # none buffered: the next row's id (ids are never reused: a retention pass keeps the newest row)
    new = (
        int(row[0])
        if row
        else int(c.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM trajectories").fetchone()[0])
    )
    if new != floor:
        c.execute("INSERT OR REPLACE INTO buffer_floor (id, first_id) VALUES (0, ?)", (new,))


def rebuffered(store: Store, first: int) -> None:
    """Trajectories from id `first` on may be buffered again: lower the buffer's floor to it (inside
    the transaction that buffers them)."""
    with store.write() as c:
        c.execute(
            "INSERT INTO buffer_floor (id, first_id) VALUES (0, ?) "
            "ON CONFLICT(id) DO UPDATE SET first_id = MIN(first_id, excluded.first_id)",
            (first,),
        )


def sample_rows(store: Store, ids: list[int]) -> dict[int, dict[str, Any]]:
    """Id -> row (id, tokens, loss_mask, logprobs, versions, reward, advantage, temperature, top_p, top_k)."""
    if not ids:
        return {}
    rows = store.query(
        "SELECT id, reward, advantage, temperature, top_p, top_k "
        f"FROM trajectories WHERE id IN ({_marks(len(ids))})",
        tuple(ids),
    )
    return {r["id"]: r for r in token_groups.with_arrays(rows, token_groups.arrays(store, ids))}


def reward_by_version(store: Store, policy: str) -> list[tuple[int, float, int]]:
    """(oldest token version, mean reward, trajectories) per version, in version order (-1: no token)."""
    return [
        (int(r[0]), float(r[1]), int(r[2]))
        for r in store.query(
            f"SELECT min_version, AVG(reward), COUNT(*) FROM trajectories WHERE {_ANY_STATUS} AND policy = ? "
            "GROUP BY min_version ORDER BY min_version",
            (policy,),
        )
    ]


def mixed_by_version(store: Store, policy: str, tol: float) -> list[tuple[int, float]]:
    """Per version of a group's oldest token (>= 0), the share of groups whose rewards differ by > tol."""
    return [
        (int(r[0]), float(r[1]))
        for r in store.query(
            "SELECT v, AVG(mixed) FROM (SELECT MIN(min_version) AS v, (MAX(reward) - MIN(reward) > ?) AS mixed "
            f"FROM trajectories WHERE {_ANY_STATUS} AND policy = ? GROUP BY task_id) WHERE v >= 0 GROUP BY v ORDER BY v",
            (tol, policy),
        )
    ]


NULL_FLOATS = "reward IS NULL OR advantage IS NULL OR temperature IS NULL OR top_p IS NULL"
"""A trajectory row with one of these NULL cannot become a TrainSample (SQLite stores a NaN as NULL)."""


def null_float_ids(store: Store) -> set[int]:
    """Ids of trajectories with a NULL where a float belongs (NULL_FLOATS)."""
    return {int(r[0]) for r in store.query(f"SELECT id FROM trajectories WHERE {NULL_FLOATS}")}


def mark_dropped(store: Store, ids: list[int]) -> None:
    """Mark these trajectories dropped (never to be trained on)."""
    forget_counts(store)  # consumed and expired ones among them too (a poisoned batch's)
    with store.write() as c:
        c.executemany("UPDATE trajectories SET status = 'dropped' WHERE id = ?", [(i,) for i in ids])


def generated_between(store: Store, t0: float, t1: float) -> dict[str, tuple[int, int]]:
    """Per policy, (trajectories, their generated tokens) stored from tasks whose result came in [t0, t1]."""
    rows = store.query(
        "SELECT t.policy, COUNT(*), COALESCE(SUM(t.length), 0) FROM trajectories t "
        "JOIN tasks k ON t.task_id = k.id WHERE k.updated BETWEEN ? AND ? GROUP BY t.policy",
        (t0, t1),
    )
    return {str(p): (int(n), int(tok)) for p, n, tok in rows}

"""Read-only questions the dashboard, `runs` and `export` ask of a run's state.db.

Every query here touches a bounded number of rows (primary-key ranges, LIMITs, indexed columns), so
polling them while the controller writes costs the run nothing but a WAL read snapshot.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.protocol import packed
from astraflow.state import tasks, token_groups
from astraflow.state.store import StateError, Store

BUSY_TIMEOUT_S = 0.2
"""How long a dashboard read waits on a locked database before skipping this poll."""


def open_for_reading(path: Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Store:
    """Open state.db read-only with a short busy timeout, so a reader never waits long on the writer;
    the connection may be used from any one thread at a time."""
    if not path.is_file():
        raise StateError(f"no state file at {path}", hint="pass the run directory of an existing run")
    conn = sqlite3.connect(
        f"file:{path.resolve()}?mode=ro",
        uri=True,
        isolation_level=None,
        timeout=busy_timeout_s,
        check_same_thread=False,  # a dashboard polls from a worker thread; callers serialise use
    )
    return Store(conn, readonly=True)


@dataclass
class Sample:
    """One stored trajectory as the sample browser shows it."""

    id: int
    task_id: int
    policy: str
    prompt_key: str
    tokens: list[int]
    loss_mask: list[int]
    versions: list[int]
    reward: float
    advantage: float
    status: str
    consumed_step: int | None
    logprobs: list[float] = field(default_factory=list)


_SAMPLE_COLS = "id, task_id, policy, prompt_key, reward, advantage, status, consumed_step"


def _sample(r: Any, with_logprobs: bool) -> Sample:
    """One trajectories row as a Sample (logprobs only when the row carries them)."""
    return Sample(
        id=int(r["id"]),
        task_id=int(r["task_id"]),
        policy=r["policy"],
        prompt_key=r["prompt_key"] or "",
        tokens=packed.ints(r["tokens"]),
        loss_mask=list(r["loss_mask"]),
        versions=packed.ints(r["versions"]),
        reward=float(r["reward"]),
        advantage=float(r["advantage"] or 0.0),
        status=r["status"],
        consumed_step=None if r["consumed_step"] is None else int(r["consumed_step"]),
        logprobs=packed.floats(r["logprobs"]) if with_logprobs else [],
    )


def require_packed(store: Store) -> None:
    """Refuse a state.db in an older layout, not opened since by a controller (which converts it):
    per-token msgpack lists (before protocol 6) would be misread as packed arrays, and arrays still in
    the trajectory rows (before their table of their own, state/token_groups.py) would not be found."""
    from astraflow.state.migrations import PACKED_MIGRATION, TOKEN_GROUPS_MIGRATION

    has = store.scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'migrations'")
    done = (
        {
            r[0]
            for r in store.query(
                "SELECT name FROM migrations WHERE name IN (?, ?)", (PACKED_MIGRATION, TOKEN_GROUPS_MIGRATION)
            )
        }
        if has
        else set()
    )
    if PACKED_MIGRATION not in done:
        raise StateError(
            "this state.db stores token lists in the msgpack format of protocol 5 and earlier; this astraflow reads "
            "packed arrays (protocol 6)",
            hint="open the run once with this version's `astraflow controller` (it converts them), or read "
            "it with the astraflow that wrote it",
        )
    if TOKEN_GROUPS_MIGRATION not in done:
        raise StateError(
            "this state.db keeps per-token arrays in its trajectory rows; this astraflow reads them from "
            "their own table (token_groups)",
            hint="open the run once with this version's `astraflow controller` (it moves them), or read "
            "it with the astraflow that wrote it",
        )


def recent_samples(store: Store, policy: str, limit: int = 50, with_logprobs: bool = False) -> list[Sample]:
    """The newest trajectories of a policy, newest first."""
    require_packed(store)
    rows = store.query(
        f"SELECT {_SAMPLE_COLS} FROM trajectories WHERE policy = ? ORDER BY id DESC LIMIT ?", (policy, limit)
    )
    out = [_sample(r, with_logprobs) for r in _with_arrays(store, rows)]
    if len(out) < limit:
        out += _archived_newest(store, policy, limit - len(out), with_logprobs)
    return out


def _archived_newest(store: Store, policy: str, limit: int, with_logprobs: bool) -> list[Sample]:
    """The newest archived trajectories of a policy (state/archive.py), newest first; newest files first."""
    from astraflow.state import archive

    out: list[Sample] = []
    base = archive.run_dir_of(store)
    for name, _, _ in reversed(archive.files(store)):
        if not (base / name).is_file():
            continue
        rows = [r for r in archive.read_file(base / name) if r["policy"] == policy]
        out += [_sample(r, with_logprobs) for r in sorted(rows, key=lambda r: -int(r["id"]))]
        if len(out) >= limit:
            break
    return sorted(out, key=lambda smp: -smp.id)[:limit]


def every_sample(store: Store, page: int = 10_000) -> Iterator[Sample]:
    """Every trajectory of the run, by id: those in state.db and those a retention pass archived."""
    import heapq

    require_packed(store)

    from astraflow.state import archive

    def stored() -> Iterator[Sample]:
        after = 0
        while True:
            batch = all_samples(store, after, page)
            if not batch:
                return
            yield from batch
            after = batch[-1].id

    archived = (_sample(r, True) for r in archive.iter_rows(store))
    yield from heapq.merge(stored(), archived, key=lambda smp: smp.id)


def all_samples(store: Store, after_id: int = 0, limit: int = 10_000) -> list[Sample]:
    """Trajectories of every policy with id > after_id, oldest first (for export, in pages)."""
    rows = store.query(
        f"SELECT {_SAMPLE_COLS} FROM trajectories WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit)
    )
    return [_sample(r, True) for r in _with_arrays(store, rows)]


def _with_arrays(store: Store, rows: list[sqlite3.Row]) -> list[dict[str, Any]]:
    """Trajectory rows with their per-token arrays (state/token_groups.py)."""
    return token_groups.with_arrays(rows, token_groups.arrays(store, [int(r["id"]) for r in rows]))


def staleness_histogram(store: Store, policy: str, window: int = 4096) -> dict[int, int]:
    """Staleness (batch version - oldest token version) -> count over the newest `window` consumed
    trajectories of a policy (a primary-key range, so the cost does not grow with the run)."""
    top = int(store.scalar("SELECT COALESCE(MAX(id), 0) FROM trajectories") or 0)
    rows = store.query(
        "SELECT b.version - t.min_version AS s, COUNT(*) AS n FROM trajectories t "
        "JOIN batches b ON b.policy = t.policy AND b.step = t.consumed_step "
        "WHERE t.id > ? AND t.policy = ? AND t.status = 'consumed' GROUP BY s ORDER BY s",
        (top - window, policy),
    )
    return {int(r["s"]): int(r["n"]) for r in rows if r["s"] is not None}


def tasks_done_by_member(store: Store) -> dict[str, int]:
    """Member id -> tasks it completed (the ledger keeps the owner of a done task)."""
    rows = store.query("SELECT owner, COUNT(*) AS n FROM tasks WHERE status = 'done' GROUP BY owner")
    out = tasks.retired_done(store)
    for r in rows:
        out[r["owner"]] = out.get(r["owner"], 0) + int(r["n"])
    return out


def events_since(store: Store, after_id: int = 0, limit: int = 200) -> list[dict[str, Any]]:
    """Events with id > after_id (the newest `limit` of them), oldest first, with their ids."""
    rows = store.query(
        "SELECT id, time, kind, detail FROM events WHERE id > ? ORDER BY id DESC LIMIT ?", (after_id, limit)
    )
    return [dict(r) for r in reversed(rows)]


def failed_tasks(store: Store, limit: int = 20) -> list[dict[str, Any]]:
    """The newest failed tasks with their error (a failing workflow shows up here)."""
    rows = store.query(
        "SELECT id, prompt_key, attempts, error, updated FROM tasks WHERE status = 'failed' "
        "ORDER BY updated DESC LIMIT ?",
        (limit,),
    )
    return [dict(r) for r in rows]


def last_update(store: Store) -> float:
    """UNIX time of the newest recorded version, metrics row or event (0.0 on an empty run)."""
    v = store.scalar(
        "SELECT MAX(t) FROM (SELECT MAX(created) AS t FROM versions UNION ALL "
        "SELECT MAX(time) FROM metrics UNION ALL SELECT MAX(time) FROM events)"
    )
    return float(v or 0.0)


def member_hosts(store: Store) -> dict[str, str]:
    """Member id -> host it runs on (with its pid), as it said in its Hello."""
    rows = store.query("SELECT id, host, pid FROM members")
    return {r["id"]: f"{r['host'] or '?'}:{r['pid'] or '?'}" for r in rows}

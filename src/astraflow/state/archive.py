"""Trajectories that left state.db: a retention pass moves those a policy trained on long ago into
Parquet files under the run directory's archive/ (or drops them), and readers find them there.

Which rows leave (`controller.retention`): of one policy, those consumed at least `keep_steps` steps
before its current step, and the expired or dropped ones older than the newest of those. Buffered
rows never leave, and the newest row of the table stays (ids are never reused). A pass writes its
file first (a temporary name, fsync, rename) and then, in one transaction, deletes the rows and
records the file and its counts in the `archived` table; a kill between the two leaves a file that
no reader opens (only files recorded in `archived` are read) and rows that the next pass archives
again. Only the controller runs passes; any reader may read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.state import token_groups, trajectories
from astraflow.state.store import Store

COLUMNS = (
    "id, task_id, policy, prompt_key, tokens, loss_mask, logprobs, versions, reward, advantage, length, "
    "min_version, arrival, status, consumed_step, role, group_key, temperature, top_p, top_k"
)
"""The columns an archive file keeps, one row per trajectory: every column of its trajectory row and
its per-token arrays (packed bytes, from state/token_groups.py)."""
_COLUMN_NAMES = [c.strip() for c in COLUMNS.split(",")]
_ROW_COLUMNS = ", ".join(c for c in _COLUMN_NAMES if c not in ("tokens", "loss_mask", "logprobs", "versions"))
ARCHIVE_DIR = "archive"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise AstraflowError(
            "controller.retention.action = 'archive' needs pyarrow",
            hint="pip install 'astraflow[parquet]', or set controller.retention.action = 'drop'",
        ) from None
    return pyarrow


def require_pyarrow() -> None:
    """Raise the one-line error (with the install hint) when pyarrow is missing."""
    _pyarrow()


def run_dir_of(store: Store) -> Path:
    """The run directory of a store (the folder of its state.db)."""
    row = store.conn.execute("PRAGMA database_list").fetchone()
    return Path(row[2]).parent


def retire(store: Store, run_dir: Path, policy: str, step: int, keep_steps: int, action: str) -> int:
    """One retention pass for a policy at `step`; returns how many trajectories left state.db."""
    cut = step - keep_steps
    if cut < 1:
        return 0
    newest_consumed = store.scalar(
        "SELECT MAX(id) FROM trajectories WHERE policy = ? AND status = 'consumed' AND consumed_step <= ?",
        (policy, cut),
    )
    if newest_consumed is None:
        return 0
    top = int(store.scalar("SELECT MAX(id) FROM trajectories") or 0)
    where = (
        "WHERE policy = ? AND id < ? AND ("
        "(status = 'consumed' AND consumed_step <= ?) OR (status IN ('expired', 'dropped') AND id <= ?))"
    )
    params = (policy, top, cut, int(newest_consumed))
    small = store.query(f"SELECT {_ROW_COLUMNS} FROM trajectories {where} ORDER BY id", params)
    if not small:
        return 0
    found = token_groups.arrays(store, [int(r["id"]) for r in small])
    rows = [{c: r[c] for c in _COLUMN_NAMES} for r in token_groups.with_arrays(small, found)]
    first, last = int(rows[0]["id"]), int(rows[-1]["id"])
    name = ""
    if action == "archive":
        name = f"{ARCHIVE_DIR}/{policy}-{first:012d}-{last:012d}.parquet"
        _write(run_dir / name, rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    now = time.time()
    with store.write() as c:
        # the controller is the only writer and runs the pass in one go: the same rows as selected
        c.execute(f"DELETE FROM trajectories {where}", params)
        token_groups.delete_emptied(store, token_groups.groups_of(store, found))
        c.executemany(
            "INSERT INTO archived (file, policy, status, rows, first_id, last_id, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(name, policy, s, n, first, last, now) for s, n in sorted(counts.items())],
        )
        trajectories.consumed_changed(store, policy, -counts.get("consumed", 0))
    return len(rows)


def _write(path: Path, rows: list[Any]) -> None:
    pa = _pyarrow()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({c: [r[c] for r in rows] for c in _COLUMN_NAMES})
    tmp = path.with_suffix(".parquet.tmp")
    pa.parquet.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def archived_counts(store: Store, policy: str) -> dict[str, int]:
    """Status -> trajectories of a policy that left state.db (archived or dropped)."""
    if not _has_table(store):
        return {}
    return {
        r["status"]: int(r["n"])
        for r in store.query(
            "SELECT status, SUM(rows) AS n FROM archived WHERE policy = ? GROUP BY status", (policy,)
        )
    }


def _has_table(store: Store) -> bool:
    return bool(store.scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'archived'"))


def files(store: Store) -> list[tuple[str, int, int]]:
    """(file relative to the run directory, first id, last id) of every archive file, oldest first."""
    if not _has_table(store):
        return []
    return [
        (r["file"], int(r["first_id"]), int(r["last_id"]))
        for r in store.query(
            "SELECT file, MIN(first_id) AS first_id, MAX(last_id) AS last_id FROM archived "
            "WHERE file != '' GROUP BY file ORDER BY first_id"
        )
    ]


def read_file(path: Path) -> list[dict[str, Any]]:
    """Every row of one archive file, as dicts keyed like the trajectories columns."""
    pa = _pyarrow()
    return list(pa.parquet.read_table(path).to_pylist())


def rows_by_id(store: Store, ids: list[int], run_dir: Path | None = None) -> dict[int, dict[str, Any]]:
    """The archived rows of these ids (only the files whose id range holds one of them are read)."""
    want = set(ids)
    if not want:
        return {}
    base = run_dir if run_dir is not None else run_dir_of(store)
    out: dict[int, dict[str, Any]] = {}
    lo, hi = min(want), max(want)
    for name, first, last in files(store):
        if last < lo or first > hi:
            continue
        for r in read_file(base / name):
            if int(r["id"]) in want:
                out[int(r["id"])] = r
    return out


def iter_rows(store: Store, run_dir: Path | None = None) -> Iterator[dict[str, Any]]:
    """Every archived row, by id (for export)."""
    import heapq

    base = run_dir if run_dir is not None else run_dir_of(store)
    streams = [iter(read_file(base / name)) for name, _, _ in files(store)]
    yield from heapq.merge(*streams, key=lambda r: int(r["id"]))

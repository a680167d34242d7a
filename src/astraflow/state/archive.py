"""Trajectories that left state.db: a retention pass moves those a policy trained on long ago into
Parquet files under the run directory's archive/ (or drops them), and readers find them there.

Which rows leave (`controller.retention`): of one policy, those consumed at least `keep_steps` steps
before its current step, and the expired or dropped ones older than the newest of those. Buffered
rows never leave, and the newest row of the table stays (ids are never reused). A pass writes its
file first (a temporary name, fsync, rename) and then, in one transaction, deletes the rows and
records the file and its counts in the `archived` table; a kill between the two leaves a file that
no reader opens (only files recorded in `archived` are read) and rows that the next pass archives
again. Only the controller deletes rows; the reading half of a pass (`find`: which rows, and their
file) runs in the controller too, or in an archiver process reading state.db as any reader does
(state/archiver.py), which hands what it found to the controller's `remove`. Any reader may read.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.errors import AstraflowError
from astraflow.protocol import packed
from astraflow.state import batches, token_groups, trajectories
from astraflow.state.store import Store

COLUMNS = (
    "id, task_id, policy, prompt_key, tokens, loss_mask, logprobs, versions, reward, advantage, length, "
    "min_version, arrival, status, consumed_step, role, group_key, temperature, top_p, top_k"
)
"""The columns an archive file keeps, one row per trajectory: every column of its trajectory row and
its per-token arrays (packed bytes, from state/token_groups.py)."""
_COLUMN_NAMES = [c.strip() for c in COLUMNS.split(",")]
_ROW_NAMES = tuple(c for c in _COLUMN_NAMES if c not in ("tokens", "loss_mask", "logprobs", "versions"))
_ROW_COLUMNS = ", ".join(_ROW_NAMES)
_USUAL: dict[str, Any] = {
    "arrival": None,
    **{c: v for c, v in trajectories.DEFAULTS.items() if c != "status"},
}
"""The columns a pass does not read row by row, with the value nearly every row holds (arrival: the
row's id, as every insert writes it): a second scan reads only the rows that hold another (an older
row, a named role, a group key, sampling settings of its own, a NULL), so that a pass builds about
half the Python values it did (the pass's rows were 60% of its cost, and the pass 30% of the live
controller's time with `--keep-steps 50` at the quickstart's shape: docs/benchmarks.md)."""
_READ_NAMES = tuple(c for c in _ROW_NAMES if c != "policy" and c not in _USUAL)
_UNUSUAL = " OR ".join(
    "arrival IS NOT id" if c == "arrival" else f"{c} IS NOT {v!r}" for c, v in _USUAL.items()
)
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
    """One retention pass for a policy at `step`; returns how many trajectories left state.db.

    The rows that leave are those of `policy` with id below the table's newest and either consumed
    at a step <= step - keep_steps, or expired or dropped with an id no larger than the newest such
    consumed row's. One scan finds them (ordered by id, so those are a prefix of the candidates);
    their arrays are cut from their groups' rows with numpy and written as Parquet columns without a
    per-row Python object; the DELETE names their id runs. `drop` reads no arrays and writes no file."""
    found = find(store, run_dir, policy, step, keep_steps, action)
    return 0 if found is None else remove(store, found)


@dataclass(frozen=True)
class Found:
    """What a pass moves out of state.db (`find`), for `remove` to delete: its rows as id runs, how
    many of each status, the token groups they were in, and the archive file written (relative to
    the run directory; "" with `drop`). Plain values: an archiver process (state/archiver.py) hands
    it back to the controller."""

    policy: str
    cut: int
    """Rows consumed at this step or before leave."""
    name: str
    first: int
    last: int
    runs: list[tuple[int, int]]
    counts: dict[str, int]
    groups: list[int]

    @property
    def rows(self) -> int:
        """Trajectories the pass moves."""
        return sum(k for _, k in self.runs)


class Changed(AstraflowError):
    """Rows a pass found no longer hold what it found (only when the finding ran apart from the writer)."""


def find(store: Store, run_dir: Path, policy: str, step: int, keep_steps: int, action: str) -> Found | None:
    """The reading half of a pass: which rows leave, and with `archive` their file written (its
    temporary name, fsync, rename). Reads only: a reader of state.db may run it (state/archiver.py);
    inside one read transaction when the store is not the writer's, so that every read sees one state."""
    cut = step - keep_steps
    if cut < 1:
        return None
    if not store.readonly:
        return _find(store, run_dir, policy, cut, action)
    store.conn.execute("BEGIN")
    try:
        return _find(store, run_dir, policy, cut, action)
    finally:
        store.conn.execute("COMMIT")


def _find(store: Store, run_dir: Path, policy: str, cut: int, action: str) -> Found | None:
    high = _consumed_bound(store, policy, cut)
    if high is None:
        return None
    top = int(store.scalar("SELECT MAX(id) FROM trajectories") or 0)
    names = _READ_NAMES if action == "archive" else ("id", "status")
    cur = store.conn.cursor()
    cur.row_factory = None  # plain tuples: the rows are only transposed into columns
    cand = cur.execute(
        f"SELECT {', '.join(names)} FROM trajectories {_WHERE} ORDER BY id", (high, policy, cut)
    ).fetchall()
    if not cand:
        return None
    cols = list(zip(*cand, strict=True))
    ids = np.asarray(cols[names.index("id")], np.int64)
    statuses = cols[names.index("status")]
    consumed = np.flatnonzero(np.asarray([st == "consumed" for st in statuses], bool))
    if not len(consumed):
        return None
    bound = min(int(ids[consumed[-1]]), top - 1)  # the newest consumed row's id; the newest row stays
    n = int(np.searchsorted(ids, bound, side="right"))
    if n == 0:
        return None
    ids = ids[:n]
    kept = [c[:n] for c in cols]
    groups = token_groups.groups_between(store, int(ids[0]), int(ids[-1]))
    name = ""
    if action == "archive":
        name = f"{ARCHIVE_DIR}/{policy}-{int(ids[0]):012d}-{int(ids[-1]):012d}.parquet"
        small = dict(zip(names, kept, strict=True))
        small.update(_usual_columns(cur, _WHERE, (int(ids[-1]), policy, cut), policy, ids))
        _write(run_dir / name, small, _arrays_of(store, groups, ids))
    counts = Counter(kept[names.index("status")])
    return Found(
        policy,
        cut,
        name,
        int(ids[0]),
        int(ids[-1]),
        [(int(a), int(k)) for a, k in trajectories.id_runs(ids.tolist())],
        dict(sorted(counts.items())),
        groups,
    )


def remove(store: Store, found: Found) -> int:
    """The writing half of a pass: delete the rows `found` names and record its file and counts in
    `archived`, in one transaction; how many rows left. Each DELETE keeps the pass's condition, so a
    row that no longer meets it stays: then nothing is deleted and Changed is raised (the rows a
    pass found change only when a reader found them: the writer's own passes find and remove in one
    go)."""
    now = time.time()
    with store.write() as c:
        cur = c.executemany(
            f"DELETE FROM trajectories WHERE id >= ? AND id < ? AND {_LEAVES}",
            [(a, a + k, found.policy, found.cut) for a, k in found.runs],
        )
        if cur.rowcount != found.rows:
            raise Changed(
                f"retention pass of {found.policy}: {cur.rowcount} of the {found.rows} rows found "
                f"{found.first}..{found.last} still leave; nothing deleted"
            )
        token_groups.delete_emptied(store, found.groups)
        c.executemany(
            "INSERT INTO archived (file, policy, status, rows, first_id, last_id, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (found.name, found.policy, st, k, found.first, found.last, now)
                for st, k in found.counts.items()
            ],
        )
        for status, k in found.counts.items():
            trajectories.status_changed(store, found.policy, status, -k)
    return found.rows


_LEAVES = "policy = ? AND ((status = 'consumed' AND consumed_step <= ?) OR status IN ('expired', 'dropped'))"
"""What a row that a pass moves holds (policy, cut)."""
_WHERE = f"WHERE id <= ? AND {_LEAVES}"


_BOUNDS: weakref.WeakKeyDictionary[Store, dict[str, tuple[int, int]]] = weakref.WeakKeyDictionary()
"""The writer's store -> policy -> (cut, the highest trajectory id in its batches of steps <= cut),
from its last retention pass: the next pass reads only the batches recorded since."""


def _consumed_bound(store: Store, policy: str, cut: int) -> int | None:
    """The highest trajectory id in the recorded batches of `policy` at steps <= cut (None: none).
    A trajectory consumed at step s is in the batch of s (state/batches.py), so no row consumed by
    then has a higher id: the pass's scan stops there instead of reading the rows of the kept steps.
    The bound only narrows a scan: one too high (a batch forgotten since) reads more rows, never others."""
    kept = _BOUNDS.setdefault(store, {})
    since, high = kept.get(policy, (0, 0))
    if since > cut:
        since, high = 0, 0
    for (text,) in store.conn.execute(
        "SELECT traj_ids FROM batches WHERE policy = ? AND step > ? AND step <= ?", (policy, since, cut)
    ):
        high = max([high, *batches.decode_ids(text)])
    kept[policy] = (cut, high)
    return high or None


def _usual_columns(
    cur: Any, where: str, params: tuple[Any, ...], policy: str, ids: np.ndarray[Any, Any]
) -> dict[str, Any]:
    """The pass's policy column and its _USUAL columns for rows `ids` (ascending; `where` with
    `params` selects exactly them): the usual value everywhere (numpy where a column is numeric), then
    the rows a second scan finds holding another value, each set to it (a column that takes one
    becomes a list: the value may be NULL)."""
    n = len(ids)
    out: dict[str, Any] = {
        "policy": [policy] * n,
        "arrival": ids.copy(),
        "role": [""] * n,
        "group_key": [""] * n,
        "temperature": np.full(n, 1.0),
        "top_p": np.full(n, 1.0),
        "top_k": np.zeros(n, np.int64),
    }
    other = cur.execute(
        f"SELECT id, {', '.join(_USUAL)} FROM trajectories {where} AND ({_UNUSUAL}) ORDER BY id", params
    ).fetchall()
    if not other:
        return out
    at = np.searchsorted(ids, np.asarray([r[0] for r in other], np.int64)).tolist()
    for k, col in enumerate(_USUAL, start=1):
        values = out[col] if isinstance(out[col], list) else out[col].tolist()
        for i, r in zip(at, other, strict=True):
            values[i] = r[k]
        out[col] = values
    return out


def _arrays_of(store: Store, groups: list[int], ids: np.ndarray) -> dict[str, Any]:
    """The four per-token columns of trajectories `ids` (ascending) as pyarrow binary arrays in id
    order, cut from their groups' joined bytes by offsets (each value the bytes it was stored with)."""
    pa = _pyarrow()
    rows = store.conn.execute(
        "SELECT first_id, rows, lengths, tokens, loss_mask, logprobs, versions FROM token_groups "
        "WHERE first_id IN (SELECT value FROM json_each(?)) ORDER BY first_id",
        ("[" + ",".join(map(str, groups)) + "]",),
    ).fetchall()
    if not rows:
        raise RuntimeError(f"trajectories {int(ids[0])}..{int(ids[-1])}: no stored arrays")
    first, count, lengths, *joined = (list(c) for c in zip(*rows, strict=True))
    seq_ids = np.concatenate([f + np.arange(k, dtype=np.int64) for f, k in zip(first, count, strict=True)])
    tokens = np.concatenate([np.frombuffer(b, packed.INT32) for b in lengths]).astype(np.int64)
    where = np.searchsorted(seq_ids, ids)
    if (where >= len(seq_ids)).any() or not np.array_equal(seq_ids[np.minimum(where, len(seq_ids) - 1)], ids):
        raise RuntimeError(f"trajectories {int(ids[0])}..{int(ids[-1])}: some have no stored arrays")
    take = pa.array(where)
    out: dict[str, Any] = {}
    for col, blobs in zip(("tokens", "loss_mask", "logprobs", "versions"), joined, strict=True):
        width = packed.ITEM_BYTES[col]
        offsets = np.concatenate(([0], np.cumsum(tokens * width))).astype(np.int64)
        data = pa.py_buffer(b"".join(blobs))
        every = pa.Array.from_buffers(pa.large_binary(), len(tokens), [None, pa.py_buffer(offsets), data])
        out[col] = every.take(take).cast(pa.binary())
    return out


def _write(path: Path, small: dict[str, Any], arrays: dict[str, Any]) -> None:
    pa = _pyarrow()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({c: arrays[c] if c in arrays else pa.array(small[c]) for c in _COLUMN_NAMES})
    # a name of this process's own: an archiver left running by a killed controller may still be
    # writing the same pass's file when the next controller's archiver does
    tmp = path.with_suffix(f".parquet.{os.getpid()}.tmp")
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


READ_BATCH = 1024
"""Rows of an archive file read at a time while iterating over every archived row."""


def iter_rows(store: Store, run_dir: Path | None = None) -> Iterator[dict[str, Any]]:
    """Every archived row, by id (for export), holding READ_BATCH rows of each open file: a file is
    opened only once the merge gets to its first id, so files whose id ranges do not overlap are read
    one after the other, never all at once (one policy's files overlap only where a later pass moved
    a row that stayed buffered while newer ones left)."""
    import heapq

    base = run_dir if run_dir is not None else run_dir_of(store)
    pending = sorted(files(store), key=lambda f: f[1])
    heap: list[tuple[int, int, dict[str, Any], Iterator[dict[str, Any]]]] = []
    opened = 0

    def advance(rows: Iterator[dict[str, Any]], order: int) -> None:
        row = next(rows, None)
        if row is not None:
            heapq.heappush(heap, (int(row["id"]), order, row, rows))

    while heap or opened < len(pending):
        # a file not yet open may hold an id below every open one's next: open it first
        while opened < len(pending) and (not heap or pending[opened][1] <= heap[0][0]):
            advance(_file_rows(base / pending[opened][0]), opened)
            opened += 1
        if not heap:
            return  # the files left were empty
        _, order, row, rows = heapq.heappop(heap)
        yield row
        advance(rows, order)


def _file_rows(path: Path) -> Iterator[dict[str, Any]]:
    """One archive file's rows, READ_BATCH at a time."""
    pa = _pyarrow()
    for batch in pa.parquet.ParquetFile(path).iter_batches(batch_size=READ_BATCH):
        yield from batch.to_pylist()

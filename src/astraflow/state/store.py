"""The run's durable state: one SQLite file in WAL mode, written only by the controller.

Every write goes through `Store.write()`, a `BEGIN IMMEDIATE` transaction (nested uses join the
outer one, so a caller can make several writes atomic). Readers (`astraflow status`) open the file
read-only and never block the writer thanks to WAL.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError

if TYPE_CHECKING:
    from sqlite_utils import Database


class StateError(AstraflowError):
    """The state file cannot be opened or does not hold a run."""


def _sqlite_utils() -> Any:
    """The sqlite_utils module, imported without its optional pandas and numpy support.

    sqlite-utils imports pandas and numpy when they are installed, only to map their scalar types to
    column types; state.db holds plain Python values. Those imports are a second of the controller's
    start-up, so they are hidden while sqlite_utils loads (a module imported before is left alone)."""
    import sys

    if "sqlite_utils.db" in sys.modules:
        return sys.modules["sqlite_utils"]
    hidden = [name for name in ("pandas", "numpy") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        import sqlite_utils
    finally:
        for name in hidden:
            del sys.modules[name]
    return sqlite_utils


class Store:
    """Typed access to a run's state.db; the controller is its only writer."""

    def __init__(self, conn: sqlite3.Connection, *, readonly: bool) -> None:
        conn.row_factory = sqlite3.Row
        self.conn = conn
        self.readonly = readonly
        self._db: Database | None = None
        self.on_rollback: list[Callable[[], None]] = []
        """Called after a write transaction rolled back: holders of in-memory state that the
        transaction's statements persist (data stages, the prompt cursor) reload it from the store."""
        self.on_member_change: list[Callable[[str | None], None]] = []
        """Called with a member's id (None: any member) after a statement changed its row: holders of
        a copy of member rows (the controller's member table) drop it."""

    def member_changed(self, member_id: str | None) -> None:
        """Tell the holders of member rows that this member's row (None: any) changed."""
        for drop in self.on_member_change:
            drop(member_id)

    @property
    def db(self) -> Database:
        """A sqlite-utils view of the connection (imported on first use: readers never need it)."""
        if self._db is None:
            self._db = _sqlite_utils().Database(self.conn)
        return self._db

    @classmethod
    def open(cls, path: str | Path, *, synchronous: str = "normal") -> Store:
        """Open (creating if needed) the writer connection, enable WAL and apply pending migrations.

        synchronous="normal": a committed transaction survives the controller's process dying at any
        moment (kill -9), but an OS crash or power loss may lose the last few; "full" also survives those,
        at the cost of an fsync per commit."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: the driver opens no implicit transactions; we issue BEGIN IMMEDIATE.
        conn = sqlite3.connect(str(p), isolation_level=None, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        for f in (p, p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
            if f.exists():
                os.chmod(f, 0o600)  # the run's state is its owner's alone, whatever the umask
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', not {synchronous!r}")
        conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
        # no table declares a foreign key (this checks nothing and costs nothing); one a migration
        # adds is enforced
        conn.execute("PRAGMA foreign_keys=ON")
        store = cls(conn, readonly=False)
        db = store.db  # before migrations imports sqlite_utils the usual way (see _sqlite_utils)
        from astraflow.state import migrations

        migrations.apply(db)
        return store

    @classmethod
    def open_readonly(cls, path: str | Path) -> Store:
        """Open an existing state.db for reading only (safe while the controller writes)."""
        p = Path(path)
        if not p.is_file():
            raise StateError(f"no state file at {p}", hint="pass the run directory of an existing run")
        conn = sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True, isolation_level=None, timeout=10.0)
        return cls(conn, readonly=True)

    def close(self) -> None:
        """Close the connection (a WAL checkpoint happens on the writer's close)."""
        self.conn.close()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A BEGIN IMMEDIATE transaction, committed on exit; inside another write it joins that one."""
        if self.readonly:
            raise StateError("this store was opened read-only", hint="only the controller writes state.db")
        if self.conn.in_transaction:
            yield self.conn
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            for restore in self.on_rollback:
                restore()
            raise
        self.conn.execute("COMMIT")

    def query(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        """Rows of a read query."""
        return self.conn.execute(sql, params).fetchall()

    def scalar(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> Any:
        """The first column of the first row of a query (None when there is no row)."""
        row = self.conn.execute(sql, params).fetchone()
        return None if row is None else row[0]

    # ----- runs ---------------------------------------------------------------------------------

    def init_run(self, name: str, recipe: dict[str, Any], git_sha: str = "") -> bool:
        """Record the run once; returns False when the file already holds a run (a restart)."""
        with self.write() as c:
            if self.scalar("SELECT COUNT(*) FROM runs"):
                return False
            c.execute(
                "INSERT INTO runs (name, recipe, git_sha, created) VALUES (?, ?, ?, ?)",
                (name, json.dumps(recipe, sort_keys=True), git_sha, time.time()),
            )
            return True

    def replace_recipe(self, recipe: dict[str, Any]) -> None:
        """Store a changed recipe as the run's (a restart allowed to change it)."""
        with self.write() as c:
            c.execute("UPDATE runs SET recipe = ?", (json.dumps(recipe, sort_keys=True),))

    def run(self) -> dict[str, Any] | None:
        """The run row with its recipe parsed, or None before init_run."""
        rows = self.query("SELECT name, recipe, git_sha, created FROM runs ORDER BY id LIMIT 1")
        if not rows:
            return None
        r = dict(rows[0])
        r["recipe"] = json.loads(r["recipe"])
        return r

    # ----- policies and versions ----------------------------------------------------------------

    def ensure_policy(self, name: str, max_staleness: int) -> None:
        """Create the policy row at version 0 / step 0, or update its staleness bound."""
        with self.write() as c:
            c.execute(
                "INSERT INTO policies (name, max_staleness, version, step) VALUES (?, ?, 0, 0) "
                "ON CONFLICT(name) DO UPDATE SET max_staleness = excluded.max_staleness",
                (name, max_staleness),
            )

    def policies(self) -> list[dict[str, Any]]:
        """Every policy row: name, max_staleness, version, step."""
        return [
            dict(r)
            for r in self.query("SELECT name, max_staleness, version, step FROM policies ORDER BY rowid")
        ]

    def policy(self, name: str) -> dict[str, Any]:
        """One policy row (KeyError when unknown)."""
        rows = self.query("SELECT name, max_staleness, version, step FROM policies WHERE name = ?", (name,))
        if not rows:
            raise KeyError(name)
        return dict(rows[0])

    def record_version(
        self, policy: str, version: int, step: int, weights_addr: str, sha256: str = "", nbytes: int = 0
    ) -> bool:
        """Record a published version and advance the policy; False if this version was already recorded."""
        with self.write() as c:
            cur = c.execute(
                "INSERT OR IGNORE INTO versions (policy, version, step, weights_addr, sha256, nbytes, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (policy, version, step, weights_addr, sha256, nbytes, time.time()),
            )
            if cur.rowcount == 0:
                # A re-announce (trainer restarted, new address): refresh where to pull it.
                c.execute(
                    "UPDATE versions SET weights_addr = ?, sha256 = ? WHERE policy = ? AND version = ?",
                    (weights_addr, sha256, policy, version),
                )
            c.execute(
                "UPDATE policies SET version = MAX(version, ?), step = MAX(step, ?) WHERE name = ?",
                (version, step, policy),
            )
            return cur.rowcount > 0

    def latest_versions(self) -> list[dict[str, Any]]:
        """Per policy the newest recorded version row (policies without one are omitted), by seeks in
        the (policy, version) key: asked once a step, a read of every version row grew with the run."""
        out: list[dict[str, Any]] = []
        policy = self.scalar("SELECT MIN(policy) FROM versions")
        while policy is not None:
            sql = "SELECT policy, version, step, weights_addr, sha256, nbytes FROM versions WHERE policy = ?"
            out.append(dict(self.query(sql + " ORDER BY version DESC LIMIT 1", (policy,))[0]))
            policy = self.scalar("SELECT MIN(policy) FROM versions WHERE policy > ?", (policy,))
        return out

    # ----- members ------------------------------------------------------------------------------

    def upsert_member(
        self,
        member_id: str,
        role: str,
        *,
        policies: list[str],
        region: str = "",
        hardware: str = "",
        slots: int = 0,
        pid: int = 0,
        host: str = "",
        now: float | None = None,
    ) -> None:
        """Register a member (or re-register it after a reconnect) as alive."""
        t = time.time() if now is None else now
        with self.write() as c:
            c.execute(
                "INSERT INTO members (id, role, status, policies, region, hardware, slots, loaded, pid, host, "
                "last_seen, joined) VALUES (?, ?, 'alive', ?, ?, ?, ?, '{}', ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET role = excluded.role, status = 'alive', policies = excluded.policies, "
                "region = excluded.region, hardware = excluded.hardware, slots = excluded.slots, pid = excluded.pid, "
                "host = excluded.host, last_seen = excluded.last_seen",
                (member_id, role, json.dumps(policies), region, hardware, slots, pid, host, t, t),
            )
        self.member_changed(member_id)

    def touch_member(
        self, member_id: str, now: float, loaded: dict[str, int] | None = None, slots: int | None = None
    ) -> bool:
        """Mark an alive member seen (and what it has loaded, and its slots); False if it is not alive."""
        with self.write() as c:
            if slots is not None:
                c.execute(
                    "UPDATE members SET slots = ? WHERE id = ? AND status = 'alive'", (slots, member_id)
                )
            if loaded is None:
                cur = c.execute(
                    "UPDATE members SET last_seen = ? WHERE id = ? AND status = 'alive'", (now, member_id)
                )
            else:
                cur = c.execute(
                    "UPDATE members SET last_seen = ?, loaded = ? WHERE id = ? AND status = 'alive'",
                    (now, json.dumps(loaded, sort_keys=True), member_id),
                )
        self.member_changed(member_id)
        return cur.rowcount > 0

    def touch_members(self, touches: dict[str, tuple[float, dict[str, int] | None, int | None]]) -> None:
        """`touch_member` for many members in one transaction: id -> (now, loaded or None, slots or None)."""
        with self.write() as c:
            c.executemany(
                "UPDATE members SET last_seen = ? WHERE id = ? AND status = 'alive'",
                [(t, mid) for mid, (t, _, _) in touches.items()],
            )
            c.executemany(
                "UPDATE members SET loaded = ? WHERE id = ? AND status = 'alive'",
                [
                    (json.dumps(ld, sort_keys=True), mid)
                    for mid, (_, ld, _) in touches.items()
                    if ld is not None
                ],
            )
            c.executemany(
                "UPDATE members SET slots = ? WHERE id = ? AND status = 'alive'",
                [(n, mid) for mid, (_, _, n) in touches.items() if n is not None],
            )

    def set_member_status(self, member_id: str, status: str) -> None:
        """Set alive | dead | left."""
        with self.write() as c:
            c.execute("UPDATE members SET status = ? WHERE id = ?", (status, member_id))
        self.member_changed(member_id)

    def member(self, member_id: str) -> dict[str, Any] | None:
        """One member with policies/loaded parsed, or None."""
        rows = self.query("SELECT * FROM members WHERE id = ?", (member_id,))
        return _member(rows[0]) if rows else None

    def members(self, status: str | None = None) -> list[dict[str, Any]]:
        """Members (optionally only those with this status), oldest first."""
        if status is None:
            rows = self.query("SELECT * FROM members ORDER BY joined, id")
        else:
            rows = self.query("SELECT * FROM members WHERE status = ? ORDER BY joined, id", (status,))
        return [_member(r) for r in rows]

    # ----- stage state, metrics, events ---------------------------------------------------------

    def save_stage_state(self, policy: str, stage: int, name: str, state: dict[str, Any]) -> None:
        """Store one stage's state_dict (JSON)."""
        from astraflow.state.stage_rows import STAGE_UPSERT  # stage_rows builds on Store

        with self.write() as c:
            c.execute(STAGE_UPSERT, (policy, stage, name, json.dumps(state, sort_keys=True), time.time()))

    def load_stage_state(self, policy: str) -> dict[int, tuple[str, dict[str, Any]]]:
        """Stage index -> (name, state) saved for a policy."""
        rows = self.query("SELECT stage, name, state FROM stage_state WHERE policy = ?", (policy,))
        return {int(r["stage"]): (r["name"], json.loads(r["state"])) for r in rows}

    def add_metrics(self, policy: str, step: int, values: dict[str, float], now: float | None = None) -> None:
        """Append one metrics row of a policy's step."""
        with self.write() as c:
            c.execute(
                'INSERT INTO metrics (policy, step, "values", time) VALUES (?, ?, ?, ?)',
                (policy, step, json.dumps(values, sort_keys=True), time.time() if now is None else now),
            )

    def merge_metrics(self, policy: str, step: int, values: dict[str, float]) -> dict[str, float]:
        """Add to a step's metrics row the values of names it lacks (the row keeps every value it has);
        returns those added (none when the step has no row)."""
        with self.write() as c:
            row = c.execute(
                'SELECT id, "values" FROM metrics WHERE policy = ? AND step = ? ORDER BY id DESC LIMIT 1',
                (policy, step),
            ).fetchone()
            if row is None:
                return {}
            have = json.loads(row[1])
            added = {k: v for k, v in values.items() if k not in have}
            if added:
                c.execute(
                    'UPDATE metrics SET "values" = ? WHERE id = ?',
                    (json.dumps({**have, **added}, sort_keys=True), row[0]),
                )
            return added

    def last_metrics(self, policy: str) -> dict[str, float] | None:
        """The newest metrics row of a policy, or None."""
        v = self.scalar('SELECT "values" FROM metrics WHERE policy = ? ORDER BY id DESC LIMIT 1', (policy,))
        return None if v is None else json.loads(v)

    def metrics_rows_newest_first(self) -> Iterator[dict[str, Any]]:
        """Every step's metrics row as its sinks received it (`policy` and the numbers), newest first
        (lazily: a reader that stops early reads only what it needs)."""
        cur = self.conn.execute('SELECT policy, "values" FROM metrics ORDER BY id DESC')
        for policy, values in cur:
            yield {"policy": policy, **json.loads(values)}

    def add_event(self, kind: str, detail: str = "", now: float | None = None) -> None:
        """Append an event (member joined/died/left, restart, ...)."""
        with self.write() as c:
            c.execute(
                "INSERT INTO events (time, kind, detail) VALUES (?, ?, ?)",
                (time.time() if now is None else now, kind, detail),
            )

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest events, oldest first."""
        rows = self.query("SELECT time, kind, detail FROM events ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(r) for r in reversed(rows)]


def skipped_steps(store: Store) -> dict[str, list[int]]:
    """Policy -> the steps its trainer skipped (non-finite loss or gradient norm), from the events."""
    out: dict[str, list[int]] = {}
    for r in store.query("SELECT detail FROM events WHERE kind = 'step_skipped' ORDER BY id"):
        d = json.loads(r["detail"])
        out.setdefault(str(d["policy"]), []).append(int(d["step"]))
    return out


def _member(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["policies"] = json.loads(d["policies"] or "[]")
    d["loaded"] = json.loads(d["loaded"] or "{}")
    return d

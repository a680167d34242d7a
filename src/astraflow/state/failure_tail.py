"""Follow a run's task failures in state.db for the `up` console: one summary line per second at most."""

from __future__ import annotations

import sqlite3
from pathlib import Path


class FailureTail:
    """Reads new `task_failed` / `run_failed` / `member_error` / `sink_failed` events (read-only) and
    summarises them."""

    KINDS = ("task_failed", "run_failed", "member_error", "sink_failed")

    def __init__(self, db: Path) -> None:
        self.db = db
        self.last_id = 0

    def read(self) -> list[str]:
        """Console lines for the events since the last call: the newest of each kind, with a count."""
        if not self.db.is_file():
            return []
        try:
            conn = sqlite3.connect(f"file:{self.db.resolve()}?mode=ro", uri=True, timeout=1.0)
            try:
                rows = conn.execute(
                    "SELECT id, kind, detail FROM events WHERE id > ? AND kind IN (?, ?, ?, ?) ORDER BY id",
                    (self.last_id, *self.KINDS),
                ).fetchall()
            finally:
                conn.close()
        except sqlite3.Error:
            return []  # the controller is creating or migrating the file: next time
        if not rows:
            return []
        self.last_id = int(rows[-1][0])
        out = []
        for kind in self.KINDS:
            mine = [r for r in rows if r[1] == kind]
            if mine:
                more = f" (+{len(mine) - 1} more)" if len(mine) > 1 else ""
                out.append(f"[{kind.replace('_', ' ')}] {str(mine[-1][2])[:300]}{more}")
        return out

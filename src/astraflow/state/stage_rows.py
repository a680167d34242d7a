"""A data stage's saved state as the one writer last wrote it: a row written only when its text changed.

The pipeline saves every stage of a policy (and its counters) after each message that may change
them: a result, a refill, a batch, a version. Most of a batch's and a version's saves find the
state as it was; `StageRows.save` compares the state's JSON text (the text `Store.save_stage_state`
writes) with the text this writer last wrote for that row and skips the statement when they are
equal. A rollback forgets every text (`forget`): the row may hold an older one again.
"""

from __future__ import annotations

import json
import time
from typing import Any

from astraflow.state.store import Store

STAGE_UPSERT = (
    "INSERT INTO stage_state (policy, stage, name, state, updated) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT(policy, stage) DO UPDATE SET name = excluded.name, state = excluded.state, "
    "updated = excluded.updated"
)
"""Write one data stage's saved state (policy, stage, name, JSON text, time); `Store.save_stage_state`
uses it too."""


class StageRows:
    """The stage_state rows of one store's data stages, as last written."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.texts: dict[tuple[str, int], tuple[str, str]] = {}
        """(policy, stage index) -> (stage name, state's JSON text) last written in a transaction
        that has not rolled back."""
        store.on_rollback.append(self.forget)

    def save(self, states: list[tuple[str, int, str, dict[str, Any]]]) -> int:
        """Write each (policy, stage index, stage name, state) whose row does not already hold it, in
        one transaction (none when every row does); how many rows were written."""
        changed = []
        for policy, stage, name, state in states:
            got = (name, json.dumps(state, sort_keys=True))
            if self.texts.get((policy, stage)) != got:
                changed.append(((policy, stage), got))
        if not changed:
            return 0
        now = time.time()
        with self.store.write() as c:
            for (policy, stage), (name, text) in changed:
                c.execute(STAGE_UPSERT, (policy, stage, name, text, now))
                self.texts[(policy, stage)] = (name, text)
        return len(changed)

    def forget(self) -> None:
        """A transaction rolled back: write every row again at its next save."""
        self.texts.clear()

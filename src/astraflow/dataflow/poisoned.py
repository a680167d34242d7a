"""Trajectories a store holds with a NULL float, and the batches they made undeliverable.

SQLite stores a NaN as NULL. Versions before results were bounded could store one (a NaN advantage
of rewards that overflowed), and every BatchRequest for a step holding such a row then failed,
also after a restart. Nothing today stores one (dataflow/limits.py, advantages.py); this repairs a
store that already has them, when the controller starts: such rows are dropped, and a batch that
holds one, never delivered, is forgotten, its other fresh trajectories buffered again, so the step
is composed anew. A `poisoned_dropped` event says what was done.
"""

from __future__ import annotations

from astraflow.state import batches, trajectories
from astraflow.state.store import Store


def drop_poisoned(store: Store) -> str:
    """Repair the store (inside one write); returns what was done ('' when nothing was poisoned)."""
    with store.write():
        bad = trajectories.null_float_ids(store)
        if not bad:
            return ""
        forgotten: list[str] = []
        for policy, step, ids in batches.all_batches(store):
            if bad.isdisjoint(ids):
                continue
            # never delivered (building its samples always failed): no trainer trained this step
            batches.forget_batch(store, policy, step, [i for i in ids if i not in bad])
            forgotten.append(f"{policy} step {step}")
        trajectories.mark_dropped(store, sorted(bad))
        detail = f"{len(bad)} trajectories with a NULL (NaN) reward or advantage dropped" + (
            f"; undeliverable batches forgotten and composed again: {', '.join(forgotten)}"
            if forgotten
            else ""
        )
        store.add_event("poisoned_dropped", detail)
    return detail

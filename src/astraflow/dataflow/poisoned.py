"""Trajectories a store holds with a NULL float, and the batches they made undeliverable.

SQLite stores a NaN as NULL. Versions before results were bounded could store one (a NaN advantage
of rewards that overflowed), and every BatchRequest for a step holding such a row then failed,
also after a restart. Nothing today stores one (dataflow/limits.py, advantages.py); this repairs a
store that already has them, when the controller starts: such rows are dropped, and a batch that
holds one, never delivered, is forgotten, its other fresh trajectories buffered again, so the step
is composed anew. A `poisoned_dropped` event says what was done.
"""

from __future__ import annotations

from astraflow.state import batches
from astraflow.state.store import Store

NULL_FLOATS = "reward IS NULL OR advantage IS NULL OR temperature IS NULL OR top_p IS NULL"
"""A trajectory row with one of these NULL cannot become a TrainSample."""


def drop_poisoned(store: Store) -> str:
    """Repair the store (inside one write); returns what was done ('' when nothing was poisoned)."""
    with store.write() as c:
        bad = {int(r[0]) for r in c.execute(f"SELECT id FROM trajectories WHERE {NULL_FLOATS}")}
        if not bad:
            return ""
        forgotten: list[str] = []
        for r in c.execute("SELECT policy, step, traj_ids FROM batches").fetchall():
            ids = batches.decode_ids(r["traj_ids"])
            if bad.isdisjoint(ids):
                continue
            # never delivered (building its samples always failed): no trainer trained this step
            c.execute("DELETE FROM batches WHERE policy = ? AND step = ?", (r["policy"], r["step"]))
            c.executemany(
                "UPDATE trajectories SET status = 'buffered', consumed_step = NULL "
                "WHERE id = ? AND consumed_step = ? AND status = 'consumed'",
                [(i, r["step"]) for i in ids if i not in bad],
            )
            forgotten.append(f"{r['policy']} step {r['step']}")
        c.executemany("UPDATE trajectories SET status = 'dropped' WHERE id = ?", [(i,) for i in sorted(bad)])
        detail = f"{len(bad)} trajectories with a NULL (NaN) reward or advantage dropped" + (
            f"; undeliverable batches forgotten and composed again: {', '.join(forgotten)}"
            if forgotten
            else ""
        )
        store.add_event("poisoned_dropped", detail)
    return detail

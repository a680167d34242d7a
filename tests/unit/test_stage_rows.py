"""The data stages' state written only when it changed (state/stage_rows.py): after every message
of whole steps on a real Controller and state.db driven without sockets, each stage_state row of a
policy holds exactly the state a save of every stage would write; a batch's and a version's saves
that change nothing write nothing; a rollback makes the next save write again."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from astraflow.bench import control_inproc as inproc
from astraflow.dataflow.pipeline import COUNTERS_STAGE
from astraflow.protocol import messages as m
from astraflow.state.store import Store
from tests.dispatch_controller import traced


def _rows(store: Store) -> dict[tuple[str, int], tuple[str, str]]:
    rows = store.conn.execute("SELECT policy, stage, name, state FROM stage_state WHERE policy != ''")
    return {(r[0], int(r[1])): (r[2], r[3]) for r in rows}


def _current(d: inproc._Driver) -> dict[tuple[str, int], tuple[str, str]]:
    out = {}
    for name, ps in d.ctl.pipeline.policies.items():
        for i, stage in enumerate(ps.stages):
            out[(name, i)] = (type(stage).__name__, json.dumps(stage.state_dict(), sort_keys=True))
        out[(name, COUNTERS_STAGE)] = ("pipeline", json.dumps(dict(ps.counters), sort_keys=True))
    return out


class _Checked(inproc._Driver):
    """After every message: the rows are the stages' current state; the statements are recorded."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.writes: dict[str, list[int]] = {}

    def send(self, ident: str, msg: m.Msg) -> list[m.Msg]:
        with traced(self.ctl.store) as seen:
            replies = super().send(ident, msg)
        assert _rows(self.ctl.store) == _current(self), type(msg).__name__
        n = sum(q.startswith("INSERT INTO stage_state") and "'pipeline'" in q for q in seen)
        self.writes.setdefault(type(msg).__name__, []).append(n)
        return replies


def test_rows_hold_the_current_state_and_unchanged_saves_write_nothing(tmp_path: Path) -> None:
    d = _Checked(tmp_path)
    inproc.join(d)
    inproc.run_steps(d, 1, 4, random.Random(2), 3)
    assert sum(d.writes["TaskResults"]) >= 8  # the results change the counters: written each time
    assert sum(d.writes["BatchRequest"]) == 0 and sum(d.writes["VersionPublished"]) == 0
    assert len(d.writes["VersionPublished"]) == 4

    # a transaction that saved and then rolled back: the row holds the old state again, and the
    # next save writes the current one even though this writer wrote that text before
    pipeline, store = d.ctl.pipeline, d.ctl.store
    before = _rows(store)
    with pytest.raises(RuntimeError), store.write():
        pipeline.policies[inproc.POLICY].counters["groups_kept"] += 1000
        pipeline.save(inproc.POLICY)
        assert _rows(store) != before
        raise RuntimeError("handler failed")
    assert _rows(store) == before == _current(d)  # the rollback reloaded the stages too
    pipeline.policies[inproc.POLICY].counters["groups_kept"] += 1000
    pipeline.save(inproc.POLICY)
    assert _rows(store) == _current(d) != before
    store.close()

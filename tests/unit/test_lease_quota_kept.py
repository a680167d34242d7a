"""A task request's member quota (max_member_share) reads the open tasks from the lease call's kept
counts per shape (state/open_shapes.py) and the member's leases from the (owner, status) index:
the same (held, open) as the read of every open task, checked on a real Controller and state.db
driven without sockets, with that read gone from every task request."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from astraflow.bench import control_inproc as inproc
from astraflow.protocol import messages as m
from astraflow.state import member_health
from astraflow.state.store import Store

FULL = (
    "SELECT SUM(status = 'leased' AND owner = ?) AS held, COUNT(*) AS open FROM tasks "
    "WHERE status IN ('queued', 'leased')"
)


def _stored(store: Store, member_id: str, trace: Any = None) -> tuple[int, int]:
    store.conn.set_trace_callback(None)  # the check's own read is not the controller's
    r = store.conn.execute(FULL, (member_id,)).fetchone()
    store.conn.set_trace_callback(trace)
    return int(r[0] or 0), int(r[1] or 0)


def test_quota_counts_match_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[tuple[int, int], tuple[int, int]]] = []
    statements: list[str] = []
    real = member_health.held_and_open

    def checked(store: Store, member_id: str) -> tuple[int, int]:
        got = real(store, member_id)
        asked.append((got, _stored(store, member_id, statements.append)))
        return got

    monkeypatch.setattr(member_health, "held_and_open", checked)
    d = inproc._Driver(tmp_path)
    inproc.join(d)
    d.ctl.store.conn.set_trace_callback(statements.append)
    inproc.run_steps(d, 1, 4, random.Random(1), 3)
    # a member that holds leases and asks again before answering: held > 0
    grant = d.send(inproc.WORKERS[0], m.TaskRequest(n=4, loaded={inproc.POLICY: 4}, wait_s=0.0))[0]
    more = d.send(inproc.WORKERS[0], m.TaskRequest(n=4, loaded={inproc.POLICY: 4}, wait_s=0.0))[0]
    d.ctl.store.conn.set_trace_callback(None)
    assert isinstance(grant, m.TaskGrant) and isinstance(more, m.TaskGrant)
    assert len(asked) >= 10
    assert all(got == stored for got, stored in asked), [a for a in asked if a[0] != a[1]][:3]
    assert any(got[0] > 0 for got, _ in asked)  # a member holding leases was counted
    assert not [q for q in statements if "SUM(status = 'leased'" in q]
    # outside a lease call the store is read, as before
    member: Any = inproc.WORKERS[0]
    assert real(d.ctl.store, member) == _stored(d.ctl.store, member)
    d.ctl.store.close()

"""A task request that admission refuses reads no queued task: one GROUP BY of the queue's shapes
answers it (roles/controller/tasks.py), on a real Controller and state.db driven without sockets."""

from __future__ import annotations

import random
from pathlib import Path

from astraflow.bench import control_inproc as inproc
from astraflow.protocol import messages as m
from astraflow.state.tasks import leases_held, status_count

WORKER = inproc.WORKERS[0]


def test_a_refused_request_reads_no_queued_task(tmp_path: Path) -> None:
    d = inproc._Driver(tmp_path)
    inproc.join(d)
    inproc.run_steps(d, 1, 3, random.Random(0), 3)
    # a worker still on version 0 takes what admission lets it (nothing more is answered)
    while (grant := d.send(WORKER, m.TaskRequest(n=4, loaded={"main": 0}, wait_s=0.0))[0]).tasks:
        assert isinstance(grant, m.TaskGrant)
    store = d.ctl.store
    queued = status_count(store, "queued")
    assert queued > 0 and leases_held(store, WORKER) < d.slots  # refused by admission, not by quota
    seen: list[str] = []
    store.conn.set_trace_callback(seen.append)
    grant = d.send(WORKER, m.TaskRequest(n=4, loaded={"main": 0}, wait_s=0.0))[0]
    store.conn.set_trace_callback(None)
    assert isinstance(grant, m.TaskGrant) and grant.tasks == []
    assert not [s for s in seen if "status = 'queued' AND id >" in s], seen  # the queue was not read
    assert status_count(store, "queued") == queued
    # a worker on the newest version is leased the same queue's tasks
    grant = d.send(WORKER, m.TaskRequest(n=4, loaded={"main": 3}, wait_s=0.0))[0]
    assert isinstance(grant, m.TaskGrant) and len(grant.tasks) > 0
    store.close()

"""`kill -9` of the controller mid-run: restarted on the same run directory, the run continues from
its state.db and completes; members find it again by themselves."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from astraflow.state.batches import decode_ids
from tests.chaos.cluster import Cluster, ro


@pytest.mark.chaos
@pytest.mark.timeout(600)  # its subprocesses have their own, longer limits
def test_kill_9_controller_and_restart(tiny_model: Path, tmp_path: Path) -> None:
    steps = 10
    with Cluster(tmp_path, tiny_model, steps, "controller.member_timeout_s=3.0") as c:
        ctl = c.controller("controller-1.log")
        for i in range(2):
            c.raas(i)
        trainer = c.trainer()
        c.wait_steps(3, trainer, "trainer.log")
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        time.sleep(1.0)
        ctl2 = c.controller("controller-2.log")
        assert trainer.wait(timeout=300) == 0, c.log("trainer.log")
        assert ctl2.wait(timeout=60) == 0, c.log("controller-2.log")
    run_dir = c.run_dir
    with ro(run_dir) as db:
        assert [
            r[0] for r in db.execute("SELECT step FROM batches WHERE policy='main' ORDER BY step")
        ] == list(range(1, steps + 1))
        ids = [i for (row,) in db.execute("SELECT traj_ids FROM batches") for i in decode_ids(row)]
        assert len(ids) == len(set(ids)), "a trajectory was trained on twice across the restart"
        assert db.execute("SELECT MAX(version) FROM versions WHERE policy='main'").fetchone()[0] == steps
        group = json.loads((run_dir / "recipe.resolved.json").read_text())["policy"][0]["group_size"]
        per_task = dict(db.execute("SELECT task_id, COUNT(*) FROM trajectories GROUP BY task_id").fetchall())
        assert all(n == group for n in per_task.values())
    # every step's metrics row once, whatever the kill cut (a row committed but not yet written is
    # rewritten from state.db by the restarted controller)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))


@pytest.mark.chaos
@pytest.mark.timeout(600)  # its subprocesses have their own, longer limits
def test_a_long_poll_held_by_a_killed_controller_fails_fast_after_the_restart(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A trainer's BatchRequest held by the controller (no rollouts yet) dies with it on `kill -9`. The
    restarted controller's first HeartbeatAck names it lost, so the caller hears ConnectError about
    a second after the restart, not at its 90 s deadline (it then asks again, as after a timeout)."""
    from astraflow.errors import ConnectError
    from astraflow.protocol.messages import (
        PROTOCOL_VERSION,
        BatchReply,
        BatchRequest,
        Hello,
        StatusReply,
        StatusRequest,
    )
    from astraflow.transport.client import MemberClient

    # a member timeout longer than the test: the restarted controller still counts the trainer alive
    # (so no unknown_member and no re-join), and only the HeartbeatAck's `lost` can end the wait early
    with Cluster(tmp_path, tiny_model, 5, "controller.member_timeout_s=300.0") as c:
        ctl = c.controller("controller-1.log")
        # the client's first probe fails at once on a refused connection: wait until the controller
        # listens (it writes its address then), not for a guessed time
        deadline = time.monotonic() + 120
        while not (c.run_dir / "controller.addr").exists():
            assert ctl.poll() is None and time.monotonic() < deadline, c.log("controller-1.log")
            time.sleep(0.05)
        hello = Hello(member_id="trainer-main", role="trainer", protocol=PROTOCOL_VERSION, policies=["main"])
        client = MemberClient(c.addr, hello, connect_timeout_s=120, hang_timeout_s=600)
        try:
            client.connect()
            # answered "not ready" at once, then held for up to 2 s: no worker makes rollouts
            first = client.request(BatchRequest(policy="main", step=1, wait_s=0.0), timeout_s=60)
            assert isinstance(first, BatchReply) and not first.ready
            held = client.submit(BatchRequest(policy="main", step=1, wait_s=2.0), timeout_s=90)
            # a request sent after it on the same connection is answered: the controller has read the
            # BatchRequest (it handles a connection's messages in order) and holds it (for up to 2 s)
            assert isinstance(client.request(StatusRequest(), timeout_s=60), StatusReply)
            ctl.send_signal(signal.SIGKILL)
            ctl.wait()
            assert not held.done()
            ctl2 = c.controller("controller-2.log")
            # the restarted controller's HeartbeatAck says it never got the request ("never got"),
            # which fails it at once; its deadline would fail it with a timeout instead
            with pytest.raises(ConnectError, match="never got BatchRequest"):
                held.result(timeout=80)
            # asked again, it is answered by the restarted controller
            again = client.request(BatchRequest(policy="main", step=1, wait_s=0.0), timeout_s=60)
            assert isinstance(again, BatchReply) and not again.ready
            assert ctl2.poll() is None
        finally:
            client.close()

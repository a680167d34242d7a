"""Metrics and stage state that cannot be lost or corrupted, driven through Controller.handle on a real
state.db (no sockets; the test plays the RaaS and trainer members): a step row a kill kept from
metrics.jsonl is rewritten on restart, a metrics.jsonl that cannot be written ends the run, an optional
sink's failure becomes an event, and a handler that raises leaves the data stages as they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from astraflow import plugins
from astraflow.config.load import load_recipe
from astraflow.config.recipe import Recipe
from astraflow.data.base import GroupFilter, GroupView
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.source import PromptSource
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.state.failure_tail import FailureTail
from astraflow.state.store import Store
from tests.ports import free_port

RECIPE_TOML = """
[run]
name = "integrity"
steps = 3

[[policy]]
name = "main"
model = "{model}"
group_size = 2
batch_prompts = 1

[workflow]
name = "quickstart"
options = {{ size = 40, length = 1 }}

[rollout]
lease_timeout_s = 30.0
slots = 8

[controller]
member_timeout_s = 30.0
"""


def _recipe(model: Path, steps: int = 2, data: list[dict[str, Any]] | None = None) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "integrity", "steps": steps},
            "policy": [
                {"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1, "data": data or []}
            ],
            "workflow": {"name": "quickstart", "options": {"size": 40, "length": 1}},
            "rollout": {"lease_timeout_s": 30.0, "slots": 8},
            "controller": {"member_timeout_s": 30.0},
        }
    )


def ask(c: Controller, ident: str, msg: m.Msg) -> m.Msg:
    reply = c.dispatch(ident.encode(), msg)
    assert len(reply) == 1
    return reply[0][1]


def join(c: Controller, ident: str, role: str) -> None:
    hello = m.Hello(
        member_id=ident, role=role, protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
    )
    assert isinstance(ask(c, ident, hello), m.Welcome)


def lease(c: Controller, n: int = 8) -> list[m.Task]:
    g = ask(c, "w1", m.TaskRequest(n=n, loaded={"main": 0}))
    assert isinstance(g, m.TaskGrant), g
    return g.tasks


def result(t: m.Task, rewards: list[float]) -> m.TaskResult:
    seqs = [
        m.Sequence(
            policy="main",
            tokens=[5, 6, 7],
            loss_mask=[0, 1, 1],
            logprobs=[0.0, -0.5, -0.5],
            versions=[-1, 0, 0],
            reward=r,
            sampling=m.SamplingParams(),
        )
        for r in rewards
    ]
    return m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=[m.Episode(sequences=[s]) for s in seqs])


def take_step(c: Controller, step: int) -> m.Msg:
    """Results for one batch, the batch, and the step's version published with trainer metrics."""
    for t in lease(c, 1):
        assert isinstance(ask(c, "w1", result(t, [1.0, 0.0])), m.ResultAck)
    batch = ask(c, "trainer-main", m.BatchRequest(policy="main", step=step))
    assert isinstance(batch, m.BatchReply) and batch.ready, batch
    pub = m.VersionPublished(
        policy="main",
        version=step,
        step=step,
        weights_addr="tcp://127.0.0.1:1",
        metrics={"loss": 0.25 * step, "reward_mean": 9.0},
    )
    return ask(c, "trainer-main", pub)


def started(model: Path, run_dir: Path, **kw: Any) -> Controller:
    c = Controller(_recipe(model, **kw), run_dir, Store.open(run_dir / "state.db"))
    c.start()
    return c


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def events(c: Controller, kind: str) -> list[str]:
    return [e["detail"] for e in c.store.events(1000) if e["kind"] == kind]


def test_a_step_row_cut_off_by_a_kill_is_rewritten_on_restart(tiny_model: Path, tmp_path: Path) -> None:
    c = started(tiny_model, tmp_path, steps=3)
    join(c, "w1", "raas")
    join(c, "trainer-main", "trainer")
    assert isinstance(take_step(c, 1), m.Ack)
    # the cut: step 2 commits, and the process dies before any sink receives its row
    c.sinks.sinks = {}
    assert isinstance(take_step(c, 2), m.Ack)
    assert [r["step"] for r in rows(tmp_path)] == [1]
    # one definition per name: the batch's reward (controller) and the trainer's own, apart
    first = rows(tmp_path)[0]
    assert first["reward_mean"] == 0.5 and first["trainer/reward_mean"] == 9.0
    c.store.close()

    c2 = started(tiny_model, tmp_path, steps=3)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2]
    stored = dict(c2.store.query('SELECT "values" FROM metrics WHERE step = 2')[0])
    assert got[1] == {"policy": "main", **json.loads(stored["values"])} and got[1]["loss"] == 0.5
    assert events(c2, "metrics_rewritten") == ["1 step rows from state.db"]
    c2.sinks.close()
    c2.store.close()
    c3 = started(tiny_model, tmp_path, steps=3)  # nothing missing: nothing written twice
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    c3.store.close()


def test_a_real_controller_fails_loudly_on_a_full_disk_and_rewrites_the_rows_once_fixed(
    tiny_model: Path, tmp_path: Path
) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE_TOML.format(model=tiny_model))
    c = Controller(load_recipe(recipe), tmp_path, Store.open(tmp_path / "state.db"))
    c.start()
    join(c, "w1", "raas")
    join(c, "trainer-main", "trainer")
    assert isinstance(take_step(c, 1), m.Ack)
    c.sinks.sinks = {}  # the cut: step 2 commits, the process dies before the sinks get its row
    assert isinstance(take_step(c, 2), m.Ack)
    c.store.close()
    kept = tmp_path / "metrics.jsonl.kept"
    (tmp_path / "metrics.jsonl").rename(kept)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # a real fault: the disk is full

    def controller(log: str) -> subprocess.Popen[bytes]:
        args = [
            "controller",
            str(recipe),
            "--run-dir",
            str(tmp_path),
            "--bind",
            f"tcp://127.0.0.1:{free_port()}",
        ]
        return subprocess.Popen(
            [sys.executable, "-m", "astraflow", *args],
            stdout=(tmp_path / log).open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    full = controller("full.log")
    assert full.wait(timeout=120) == 1
    log = (tmp_path / "full.log").read_text()
    assert "metrics.jsonl cannot be written (OSError: [Errno 28] No space left on device)" in log
    st = Store.open_readonly(tmp_path / "state.db")
    assert any("No space left" in e["detail"] for e in st.events(1000) if e["kind"] == "run_failed")
    st.close()

    (tmp_path / "metrics.jsonl").unlink()
    kept.rename(tmp_path / "metrics.jsonl")
    (tmp_path / "controller.addr").unlink()
    fixed = controller("fixed.log")
    try:
        while fixed.poll() is None and not (tmp_path / "controller.addr").exists():
            time.sleep(0.05)  # the rows are rewritten before the controller listens
        assert fixed.poll() is None, (tmp_path / "fixed.log").read_text()
        assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    finally:
        fixed.send_signal(signal.SIGTERM)
        fixed.wait(timeout=60)


def test_a_metrics_jsonl_that_cannot_be_written_ends_the_run(tiny_model: Path, tmp_path: Path) -> None:
    # a real fault: metrics.jsonl on a full device (every flush fails with ENOSPC)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    c = started(tiny_model, tmp_path, steps=3)
    join(c, "w1", "raas")
    join(c, "trainer-main", "trainer")
    assert isinstance(take_step(c, 1), m.Ack)  # the step is recorded in state.db
    assert c.failed is not None and "No space left on device" in c.failed
    assert c.stopping()
    (reason,) = events(c, "run_failed")
    assert reason.startswith("metrics.jsonl cannot be written (OSError: [Errno 28] No space left on device)")
    refused = ask(c, "trainer-main", m.BatchRequest(policy="main", step=2))
    assert isinstance(refused, m.Error) and refused.code == "run_failed"
    hb = ask(c, "w1", m.Heartbeat())
    assert isinstance(hb, m.HeartbeatAck) and hb.stop


def test_an_optional_sink_failure_is_an_event_and_its_rows_follow(tiny_model: Path, tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "plugins" / "astraflow-example-sink" / "src"
    sys.path.insert(0, str(src))
    try:
        from astraflow_example_sink import CopyRowsConfig, CopyRowsSink
    finally:
        sys.path.remove(str(src))
    c = started(tiny_model, tmp_path, steps=3)
    # a real fault: the third-party sink's directory does not exist yet
    c.sinks.sinks["copy_rows"] = CopyRowsSink(CopyRowsConfig(file="later/rows.jsonl"), tmp_path)
    join(c, "w1", "raas")
    join(c, "trainer-main", "trainer")
    assert isinstance(take_step(c, 1), m.Ack)
    assert c.failed is None
    (failed,) = events(c, "sink_failed")
    assert "metric sink 'copy_rows' failed (FileNotFoundError" in failed
    # `up` prints it on the console
    (line,) = FailureTail(tmp_path / "state.db").read()
    assert line.startswith("[sink failed] metric sink 'copy_rows' failed (FileNotFoundError")
    (tmp_path / "later").mkdir()
    c.sinks.retry_at["copy_rows"] = 0.0  # its backoff ran out
    c.tick()
    assert events(c, "sink_recovered")
    copied = [json.loads(x) for x in (tmp_path / "later" / "rows.jsonl").read_text().splitlines()]
    assert copied == rows(tmp_path) and [r["step"] for r in copied] == [1]


class Explode(GroupFilter):
    """A test filter that raises while armed: the handler storing a result fails after GRESO observed it."""

    name = "explode"
    armed = False

    def keep(self, group: GroupView) -> bool:
        if Explode.armed:
            raise RuntimeError("filter bug")
        return True


def test_a_failing_handler_leaves_the_stage_state_as_before(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = plugins.load
    monkeypatch.setattr(plugins, "load", lambda g, n: Explode if n == "explode" else real(g, n))
    c = started(tiny_model, tmp_path, data=[{"name": "greso"}, {"name": "explode"}])
    join(c, "w1", "raas")
    tasks = lease(c, 2)
    assert isinstance(ask(c, "w1", result(tasks[0], [1.0, 0.0])), m.ResultAck)

    def state() -> list[Any]:
        ps = c.pipeline.policies["main"]
        return [[s.state_dict() for s in ps.stages], dict(ps.counters)]

    def saved() -> list[Any]:
        return [
            tuple(r)
            for r in c.store.query("SELECT policy, stage, name, state FROM stage_state ORDER BY 1, 2")
        ]

    before, before_saved = state(), saved()
    assert before[0][0]["observed"] == 1
    Explode.armed = True
    try:
        failed = ask(c, "w1", result(tasks[1], [0.0, 0.0]))
    finally:
        Explode.armed = False
    assert isinstance(failed, m.Error) and failed.code == "internal" and "filter bug" in failed.message
    assert state() == before and saved() == before_saved
    c.pipeline.save()  # what the next save persists is the state before the failed handler
    assert saved() == before_saved
    # the result is stored once when sent again: GRESO observed two groups, not three
    assert isinstance(ask(c, "w1", result(tasks[1], [0.0, 0.0])), m.ResultAck)
    assert state()[0][0]["observed"] == 2
    c.store.close()


def test_a_rolled_back_draw_of_prompts_is_offered_again(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    src = PromptSource(lambda _e: iter([{"prompt": str(i)} for i in range(5)]), store)
    with store.write():
        src.next()
        src.save()
    with pytest.raises(RuntimeError), store.write():
        assert src.next()[1] == {"prompt": "1"}
        src.save()
        raise RuntimeError("refill failed")
    assert (src.epoch, src.index) == (0, 1) and src.next()[1] == {"prompt": "1"}
    store.close()


def test_a_rolled_back_insert_does_not_count_as_generated(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    buf = Buffer(store)
    seq = m.Sequence(
        policy="main",
        tokens=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        versions=[-1, 0],
        sampling=m.SamplingParams(),
    )
    buf.insert(1, "a", [seq], [0.0])
    assert buf.generated("main") == 1
    with pytest.raises(RuntimeError), store.write():
        buf.insert(2, "b", [seq, seq], [0.0, 0.0])
        raise RuntimeError("handler failed after the insert")
    assert buf.generated("main") == 1  # samples_generated stays what the store holds
    store.close()


def test_a_later_announcement_adds_only_new_metrics_to_the_step_row(tiny_model: Path, tmp_path: Path) -> None:
    # a version announced first by a fast path, its delta's metrics following once the delta is held
    c = started(tiny_model, tmp_path, steps=3)
    join(c, "w1", "raas")
    join(c, "trainer-main", "trainer")
    assert isinstance(take_step(c, 1), m.Ack)
    again = m.VersionPublished(
        policy="main",
        version=1,
        step=1,
        weights_addr="tcp://127.0.0.1:1",
        metrics={"weights_delta_bytes": 0.01, "loss": 99.0, "version": 7.0, "bad": float("nan")},
    )
    ack = ask(c, "trainer-main", again)
    assert isinstance(ack, m.Ack) and ack.detail == "known"
    got = rows(tmp_path)
    # the step row as it was, then a late row of the one name it lacked (the row's own never change)
    assert [r.get("kind") for r in got] == [None, "late"]
    assert {k: v for k, v in got[1].items() if k != "time"} == {
        "kind": "late",
        "policy": "main",
        "step": 1,
        "version": 1,
        "weights_delta_bytes": 0.01,
    }
    stored = json.loads(c.store.query('SELECT "values" FROM metrics WHERE step = 1')[0]["values"])
    assert stored["weights_delta_bytes"] == 0.01 and stored["loss"] == 0.25 and stored["version"] == 1
    # the same announcement again adds nothing: no row
    assert isinstance(ask(c, "trainer-main", again), m.Ack)
    assert len(rows(tmp_path)) == 2
    c.store.close()

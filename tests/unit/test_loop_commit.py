"""The controller's loop (`Controller.serve`) handles the messages of one poll in one transaction:
one COMMIT for the pass, every reply sent only once it is on disk (a second connection sees what
the reply reports), and a message whose handler fails is rolled back alone while the others of its
pass are kept. Driven with a stand-in for the socket server on a real state.db."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller, results
from astraflow.state.store import Store

GROUP = 2
WORKERS = ("w1", "w2")


class _Server:
    """Hands the loop one list of messages per poll, then stops it; checks each reply as it is sent."""

    drained = True

    def __init__(self, ctl: Controller, passes: list[list[tuple[str, m.Msg]]], db: Path) -> None:
        self.ctl, self.passes, self.db = ctl, passes, db
        self.commits = 0
        self.sent: list[tuple[int, str, m.Msg, dict[str, Any]]] = []
        """(pass, member, reply, what a reader saw on disk when it was sent)."""
        self.at_send: list[int] = []
        """COMMITs run so far when each reply was sent."""
        self.pass_no = 0
        ctl.store.conn.set_trace_callback(self._trace)

    def _trace(self, sql: str) -> None:
        self.commits += sql == "COMMIT"

    def poll(self, timeout_ms: int) -> list[tuple[bytes, None, m.Msg]]:
        if not self.passes:
            self.ctl.loop.stop_requested = True
            return []
        self.pass_no += 1
        self.commits = 0
        return [(who.encode(), None, msg) for who, msg in self.passes.pop(0)]

    def send(self, to: bytes, reply: m.Msg) -> None:
        reader = Store.open_readonly(self.db)  # another connection: it sees only what is committed
        try:
            seen = {
                "leased": {
                    int(r["id"]): r["owner"]
                    for r in reader.query("SELECT id, owner FROM tasks WHERE status = 'leased'")
                },
                "stored": {int(r[0]) for r in reader.query("SELECT DISTINCT task_id FROM trajectories")},
            }
        finally:
            reader.close()
        self.at_send.append(self.commits)
        self.sent.append((self.pass_no, to.decode(), reply, seen))


def _controller(model: Path, run_dir: Path) -> Controller:
    recipe = Recipe.model_validate(
        {
            "run": {"name": "loop-commit", "steps": 3, "seed": 0},
            "policy": [
                {
                    "name": "main",
                    "model": str(model),
                    "group_size": GROUP,
                    "batch_prompts": 4,
                    "max_staleness": 4,
                }
            ],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"slots": 4},
        }
    )
    c = Controller(recipe, run_dir, Store.open(run_dir / "state.db"))
    c.start()
    for who in WORKERS:
        hello = m.Hello(
            member_id=who, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
        )
        assert isinstance(c.dispatch(who.encode(), hello)[0][1], m.Welcome)
    return c


def _episodes() -> list[m.Episode]:
    seq = m.Sequence(
        policy="main",
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.5],
        versions=[-1, 0, 0],
        reward=1.0,
        sampling=m.SamplingParams(),
    )
    return [m.Episode(sequences=[seq]) for _ in range(GROUP)]


def _results(grant: m.Msg) -> m.TaskResults:
    assert isinstance(grant, m.TaskGrant) and grant.tasks, grant
    return m.TaskResults.of(
        [m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes()) for t in grant.tasks]
    )


def test_a_pass_commits_once_and_answers_only_what_is_on_disk(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    server = _Server(
        c, [[(w, m.TaskRequest(n=2, loaded={"main": 0})) for w in WORKERS]], tmp_path / "state.db"
    )
    assert c.serve(server) == 0
    grants = {who: (reply, seen) for _, who, reply, seen in server.sent}
    assert set(grants) == set(WORKERS)
    for who, (grant, seen) in grants.items():
        assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 2
        # when the grant left, a reader saw both workers' leases: the pass had committed
        assert {t.task_id: who for t in grant.tasks}.items() <= seen["leased"].items()
        assert len(seen["leased"]) == 4
    assert server.at_send == [1, 1]  # both messages' writes in one COMMIT, before the first reply


def test_a_failing_message_is_rolled_back_alone(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = _controller(tiny_model, tmp_path)
    grants = {w: c.dispatch(w.encode(), m.TaskRequest(n=2, loaded={"main": 0}))[0][1] for w in WORKERS}
    failing = {t.task_id for t in grants["w1"].tasks}  # type: ignore[union-attr]
    real = results._store_group

    def store_group(ctx: Any, member: dict[str, Any], *args: Any) -> Any:
        out = real(ctx, member, *args)
        if member["id"] == "w1":  # fault injection: the handler fails after its writes completed
            raise RuntimeError("injected failure")
        return out

    monkeypatch.setattr(results, "_store_group", store_group)
    # w1's results, which fail, come first in the pass; w2's, after them, must still be stored
    passes = [[("w1", _results(grants["w1"])), ("w2", _results(grants["w2"]))]]
    server = _Server(c, passes, tmp_path / "state.db")
    assert c.serve(server) == 0
    replies = {who: (reply, seen) for _, who, reply, seen in server.sent}
    bad, seen = replies["w1"]
    assert isinstance(bad, m.Error) and bad.code == "internal" and "injected" in bad.message
    ack, _ = replies["w2"]
    assert isinstance(ack, m.ResultsAck) and {a.status for a in ack.acks} == {"accepted"}
    w2 = {t.task_id for t in grants["w2"].tasks}  # type: ignore[union-attr]
    assert seen["stored"] == w2  # nothing of w1's message, all of w2's, committed before the replies
    assert failing <= set(seen["leased"])  # w1's tasks are still leased to it (not done)
    assert server.at_send == [1, 1]
    # the rolled-back rows left no trace in what the controller keeps in memory either
    assert c.buffer.generated("main") == GROUP * len(w2)
    assert c.buffer.open_counts("main")["buffered"] == GROUP * len(w2)

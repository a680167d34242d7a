"""The results messages read in one poll, of one member or several, are taken as one TaskResults
(roles/controller/coalesce.py), driven through `Controller.coalescer` on a real state.db (no sockets;
tests/integration/test_bench_control.py runs it live, `bench control --results single` measures it):
every message gets the reply it gets alone, the same rows are stored, each result is charged to its own
member, and the run costs one transaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from tests.dispatch_controller import grant, started_controller, stored, traced

GROUP = 2


def _episodes(task_id: int, first_token: int = 5, logprob: float = -0.5) -> list[m.Episode]:
    return [
        m.Episode(
            sequences=[
                m.Sequence(
                    policy="main",
                    tokens=[first_token, 6, 7, 8 + i],
                    loss_mask=[0, 1, 1, 1],
                    logprobs=[0.0, logprob, -0.25, -0.125],
                    versions=[-1, 0, 0, 0],
                    reward=float((task_id + i) % 2),
                    sampling=m.SamplingParams(),
                )
            ]
        )
        for i in range(GROUP)
    ]


def _pair(tiny_model: Path, tmp_path: Path) -> tuple[Controller, Controller]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return (
        started_controller(tiny_model, tmp_path / "a", name="coalesce", group=GROUP),
        started_controller(tiny_model, tmp_path / "b", name="coalesce", group=GROUP),
    )


def _reply_fields(reply: m.Msg) -> tuple[Any, ...]:
    if isinstance(reply, m.ResultAck):
        return ("ack", reply.rid, reply.task_id, reply.status)
    assert isinstance(reply, m.Error), reply
    return ("error", reply.rid, reply.code, reply.message)


def _messages(tasks: list[m.Task]) -> list[m.TaskResult]:
    """Six results of five leases: accepted, a negative token id (invalid), a positive log-probability (invalid), a wrong epoch, accepted, and the first one again (a duplicate)."""
    t = tasks
    msgs = [
        m.TaskResult(task_id=t[0].task_id, epoch=t[0].epoch, episodes=_episodes(t[0].task_id)),
        m.TaskResult(
            task_id=t[1].task_id, epoch=t[1].epoch, episodes=_episodes(t[1].task_id, first_token=-3)
        ),
        m.TaskResult(task_id=t[2].task_id, epoch=t[2].epoch, episodes=_episodes(t[2].task_id, logprob=0.75)),
        m.TaskResult(task_id=t[3].task_id, epoch=t[3].epoch + 7, episodes=_episodes(t[3].task_id)),
        m.TaskResult(task_id=t[4].task_id, epoch=t[4].epoch, episodes=_episodes(t[4].task_id)),
        m.TaskResult(task_id=t[0].task_id, epoch=t[0].epoch, episodes=_episodes(t[0].task_id)),
    ]
    for rid, msg in enumerate(msgs, start=100):
        msg.rid = rid
    return msgs


def test_a_run_of_results_gets_the_replies_and_rows_each_gets_alone(tiny_model: Path, tmp_path: Path) -> None:
    alone, merged = _pair(tiny_model, tmp_path)
    ta, tm = grant(alone, 5), grant(merged, 5)
    assert [t.task_id for t in ta] == [t.task_id for t in tm]
    with traced(alone.store) as sql_alone:
        one_by_one = [alone.dispatch(b"w", msg)[0][1] for msg in _messages(ta)]
    with traced(merged.store) as sql:
        replies = list(merged.coalescer.replies([(b"w", None, msg) for msg in _messages(tm)]))
    assert [to for to, _ in replies] == [b"w"] * 6
    got = [_reply_fields(r) for _, r in replies]
    assert got == [_reply_fields(r) for r in one_by_one]
    assert [g[0] for g in got] == ["ack", "error", "error", "ack", "ack", "ack"]
    assert [g[-1] for g in got if g[0] == "ack"] == ["accepted", "stale_epoch", "accepted", "duplicate"]
    assert got[1][2] == got[2][2] == "bad_result"
    assert stored(merged) == stored(alone) and len(stored(alone)) == 2 * GROUP
    assert merged.store.load_stage_state("main") == alone.store.load_stage_state("main")
    tasks = "SELECT id, status, epoch, owner FROM tasks ORDER BY id"
    assert [tuple(r) for r in merged.store.query(tasks)] == [tuple(r) for r in alone.store.query(tasks)]
    # the valid results were stored in one transaction (the invalid ones are charged on their own)
    commits = sum(s == "COMMIT" for s in sql)
    assert commits <= sum(s == "COMMIT" for s in sql_alone) - 2, (sql, sql_alone)


def test_another_message_of_a_member_ends_the_run_before_it_is_answered(
    tiny_model: Path, tmp_path: Path
) -> None:
    c = started_controller(tiny_model, tmp_path, name="coalesce", group=GROUP)
    t = grant(c, 4)
    hello = m.Hello(
        member_id="v", role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=2, host="h"
    )
    assert isinstance(c.dispatch(b"v", hello)[0][1], m.Welcome)
    res = [
        m.TaskResult(rid=i + 1, task_id=x.task_id, epoch=x.epoch, episodes=_episodes(x.task_id))
        for i, x in enumerate(t)
    ]
    polled = [
        (b"w", None, res[0]),
        (b"v", None, m.TaskResult(rid=50, task_id=t[2].task_id, epoch=t[2].epoch, episodes=_episodes(0))),
        (b"w", None, res[1]),
        (b"w", None, m.TaskRequest(rid=9, n=8, loaded={"main": 0})),
        (b"w", None, res[2]),
        (b"w", None, res[3]),
        (b"x", None, res[3]),  # never joined
    ]
    with traced(c.store) as sql:
        replies = list(c.coalescer.replies(polled))
    order = [(to, r.rid) for to, r in replies]
    # w's first two results are answered before its task request, which then finds their slots free
    assert order.index((b"w", 1)) < order.index((b"w", 9)) and order.index((b"w", 2)) < order.index((b"w", 9))
    granted = next(r for to, r in replies if r.rid == 9)
    # 8 slots: 2 of its 4 leases still held (4 tasks free had its results come after it)
    assert isinstance(granted, m.TaskGrant) and len(granted.tasks) == 6, granted
    statuses = {r.rid: r.status for _, r in replies if isinstance(r, m.ResultAck)}
    assert statuses == {1: "accepted", 2: "accepted", 3: "accepted", 4: "accepted", 50: "stale_epoch"}
    unknown = next(r for to, r in replies if to == b"x")
    assert isinstance(unknown, m.Error) and unknown.code == "unknown_member"
    assert {r[1] for r in stored(c)} == {x.task_id for x in t}
    # two runs of two results, each one transaction: fewer commits than the six result messages
    assert sum(s == "COMMIT" for s in sql) < 6, sql


def test_a_run_refused_whole_is_answered_message_by_message(tiny_model: Path, tmp_path: Path) -> None:
    c = started_controller(tiny_model, tmp_path, name="coalesce", group=GROUP)
    t = grant(c, 2)
    res = [
        m.TaskResult(rid=i + 1, task_id=x.task_id, epoch=x.epoch, episodes=_episodes(x.task_id))
        for i, x in enumerate(t)
    ]
    # a trainer's key may not send results: the merged message is refused, then each message is
    trainer = m.Hello(
        member_id="tr", role="trainer", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=3, host="h"
    )
    assert isinstance(c.dispatch(b"tr", trainer)[0][1], m.Welcome)
    replies = list(c.coalescer.replies([(b"tr", None, r) for r in res]))
    assert [(to, r.rid) for to, r in replies] == [(b"tr", 1), (b"tr", 2)]
    assert all(isinstance(r, m.Error) and r.code == "not_authorized" for _, r in replies)
    assert stored(c) == []


def _results_reply(reply: m.Msg) -> tuple[Any, ...]:
    if isinstance(reply, m.ResultsAck):
        return ("acks", reply.rid, [(a.task_id, a.status, a.code, a.message) for a in reply.acks])
    return _reply_fields(reply)


def test_small_task_results_are_merged_and_one_whose_columns_do_not_fit_is_answered_alone(
    tiny_model: Path, tmp_path: Path
) -> None:
    alone, merged = _pair(tiny_model, tmp_path)

    def messages(t: list[m.Task]) -> list[m.Msg]:
        def out(x: m.Task, **kw: Any) -> m.Outcome:
            return m.Outcome(task_id=x.task_id, epoch=x.epoch, **({"episodes": _episodes(x.task_id)} | kw))

        broken = m.TaskResults.of([out(t[4])], rid=3)
        broken.columns.tokens = broken.columns.tokens[:-4]  # one token short: refused whole
        return [
            m.TaskResults.of([out(t[0]), out(t[1], episodes=[], error="Traceback: boom")], rid=1),
            m.TaskResult(rid=2, task_id=t[2].task_id, epoch=t[2].epoch, episodes=_episodes(t[2].task_id)),
            broken,
            m.TaskResults.of([out(t[3], episodes=_episodes(t[3].task_id, logprob=0.5)), out(t[5])], rid=4),
            m.TaskResults.of([out(x) for x in t[6:8]] + [out(t[0])] * 3, rid=5),  # 5 results: not merged
        ]

    ta, tm = grant(alone, 8), grant(merged, 8)
    with traced(alone.store) as sql_alone:
        one_by_one = [_results_reply(alone.dispatch(b"w", msg)[0][1]) for msg in messages(ta)]
    with traced(merged.store) as sql:
        got = [
            _results_reply(r) for _, r in merged.coalescer.replies([(b"w", None, x) for x in messages(tm)])
        ]
    assert got == one_by_one
    assert [g[0] for g in got] == ["acks", "ack", "error", "acks", "acks"]
    assert [a[1] for a in got[0][2]] == ["accepted", "failed"] and got[2][2] == "bad_result"
    assert [a[1] for a in got[3][2]] == ["invalid", "accepted"]
    assert [a[1] for a in got[4][2]] == ["accepted", "accepted", "duplicate", "duplicate", "duplicate"]
    assert stored(merged) == stored(alone) and len(stored(alone)) == 5 * GROUP
    assert merged.store.load_stage_state("main") == alone.store.load_stage_state("main")
    assert sum(s == "COMMIT" for s in sql) < sum(s == "COMMIT" for s in sql_alone)


def _join(c: Controller, ident: str) -> None:
    hello = m.Hello(
        member_id=ident, role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], pid=2, host="h"
    )
    assert isinstance(c.dispatch(ident.encode(), hello)[0][1], m.Welcome)


def test_results_of_several_members_are_one_transaction_each_charged_to_its_own(
    tiny_model: Path, tmp_path: Path
) -> None:
    alone, merged = _pair(tiny_model, tmp_path)

    def polled(c: Controller) -> list[tuple[bytes, None, m.Msg]]:
        _join(c, "v")
        tw = grant(c, 2)
        reply = c.dispatch(b"v", m.TaskRequest(n=2, loaded={"main": 0}))[0][1]
        assert isinstance(reply, m.TaskGrant) and len(reply.tasks) == 2
        tv = list(reply.tasks)

        def res(rid: int, t: m.Task, **kw: Any) -> m.TaskResult:
            return m.TaskResult(
                rid=rid, task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t.task_id, **kw)
            )

        return [
            (b"w", None, res(1, tw[0])),
            (b"v", None, res(2, tv[0], first_token=-3)),  # invalid: charged to v
            (b"w", None, res(3, tw[1])),
            (
                b"v",
                None,
                m.TaskResults.of(
                    [m.Outcome(task_id=tv[1].task_id, epoch=tv[1].epoch, episodes=_episodes(0))], rid=4
                ),
            ),
            (b"v", None, res(5, tw[0])),  # w's lease: not v's to complete
        ]

    with traced(alone.store) as sql_alone:
        one_by_one = [_results_reply(alone.dispatch(ident, msg)[0][1]) for ident, _, msg in polled(alone)]
    batch = polled(merged)
    with traced(merged.store) as sql:
        replies = list(merged.coalescer.replies(batch))
    assert [to for to, _ in replies] == [b"w", b"v", b"w", b"v", b"v"]
    got = [_results_reply(r) for _, r in replies]
    assert got == one_by_one
    assert [g[-1] for g in got if g[0] == "ack"] == ["accepted", "accepted", "duplicate"]
    assert got[1][2] == "bad_result" and got[3][2][0][1] == "accepted"
    assert stored(merged) == stored(alone) and len(stored(alone)) == 3 * GROUP
    charges = "SELECT id, failures, invalid FROM members ORDER BY id"
    assert [tuple(r) for r in merged.store.query(charges)] == [tuple(r) for r in alone.store.query(charges)]
    assert {r["id"]: r["invalid"] for r in merged.store.query(charges)} == {"w": 0, "v": 1}
    assert sum(s == "COMMIT" for s in sql) < sum(s == "COMMIT" for s in sql_alone)


def test_a_run_whose_handling_raises_stores_nothing_and_answers_each_message(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = started_controller(tiny_model, tmp_path, name="coalesce", group=GROUP)
    t = grant(c, 3)
    res = [
        m.TaskResult(rid=i + 1, task_id=x.task_id, epoch=x.epoch, episodes=_episodes(x.task_id))
        for i, x in enumerate(t)
    ]

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(c.pipeline, "save", broken)  # fails inside the group's transaction
    replies = list(c.coalescer.replies([(b"w", None, r) for r in res]))
    assert [(to, r.rid) for to, r in replies] == [(b"w", 1), (b"w", 2), (b"w", 3)]
    assert all(isinstance(r, m.Error) and r.code == "internal" for _, r in replies)
    assert stored(c) == []
    status = {int(r["id"]): r["status"] for r in c.store.query("SELECT id, status FROM tasks")}
    assert {status[x.task_id] for x in t} == {"leased"}  # rolled back: the leases stand

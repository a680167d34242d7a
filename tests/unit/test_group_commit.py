"""Group commit (TaskResults), driven through Controller.dispatch on a real state.db (no sockets):
many results in one message and one transaction store exactly what one TaskResult each would, and
each result gets the status it would get alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.dataflow.limits import RefusedResult
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from tests.dispatch_controller import grant, started_controller, stored

GROUP = 2


def _controller(model: Path, run_dir: Path) -> Controller:
    return started_controller(model, run_dir, name="group-commit", group=GROUP)


def _episodes(task_id: int, first_token: int = 5) -> list[m.Episode]:
    return [
        m.Episode(
            sequences=[
                m.Sequence(
                    policy="main",
                    tokens=[first_token, 6, 7, 8],
                    loss_mask=[0, 1, 1, 1],
                    logprobs=[0.0, -0.5, -0.25, -0.125],
                    versions=[-1, 0, 0, 0],
                    reward=float((task_id + i) % 2),
                    sampling=m.SamplingParams(),
                )
            ]
        )
        for i in range(GROUP)
    ]


def test_one_message_stores_what_single_results_store(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    single, grouped = _controller(tiny_model, tmp_path / "a"), _controller(tiny_model, tmp_path / "b")
    ts, tg = grant(single, 4), grant(grouped, 4)
    assert [t.task_id for t in ts] == [t.task_id for t in tg]
    for t in ts:
        ack = single.dispatch(
            b"w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t.task_id))
        )
        assert isinstance(ack[0][1], m.ResultAck) and ack[0][1].status == "accepted"
    results = [m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t.task_id)) for t in tg]
    reply = grouped.dispatch(b"w", m.TaskResults.of(results))[0][1]
    assert isinstance(reply, m.ResultsAck)
    assert [(a.task_id, a.status) for a in reply.acks] == [(t.task_id, "accepted") for t in tg]
    assert stored(grouped) == stored(single) and len(stored(single)) == 4 * GROUP
    assert grouped.store.load_stage_state("main") == single.store.load_stage_state("main")
    # the same message again: every result is a duplicate, nothing more is stored
    again = grouped.dispatch(b"w", m.TaskResults.of(results))[0][1]
    assert isinstance(again, m.ResultsAck) and {a.status for a in again.acks} == {"duplicate"}
    assert len(stored(grouped)) == 4 * GROUP


def test_each_result_gets_its_own_status(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    t = grant(c, 4)
    results = [
        m.Outcome(task_id=t[0].task_id, epoch=t[0].epoch, episodes=_episodes(t[0].task_id)),
        m.Outcome(
            task_id=t[1].task_id, epoch=t[1].epoch, episodes=_episodes(t[1].task_id, first_token=-3)
        ),  # a negative token id
        m.Outcome(task_id=t[2].task_id, epoch=t[2].epoch, error="Traceback: boom"),
        m.Outcome(
            task_id=t[3].task_id, epoch=t[3].epoch + 7, episodes=_episodes(t[3].task_id)
        ),  # wrong epoch
        m.Outcome(task_id=999_999, epoch=1, episodes=_episodes(0)),
    ]
    reply = c.dispatch(b"w", m.TaskResults.of(results))
    acks = [r for to, r in reply if to == b"w"][0]
    assert isinstance(acks, m.ResultsAck)
    assert [a.status for a in acks.acks] == ["accepted", "invalid", "failed", "stale_epoch", "unknown_task"]
    assert acks.acks[1].code == "bad_result" and "task" in acks.acks[1].message
    kept = {r[1] for r in stored(c)}
    assert kept == {t[0].task_id}
    # the invalid and the failed one went back to the queue for another attempt
    status = {int(r["id"]): r["status"] for r in c.store.query("SELECT id, status FROM tasks")}
    assert status[t[1].task_id] == "queued" and status[t[2].task_id] == "queued"
    assert status[t[0].task_id] == "done" and status[t[3].task_id] == "leased"


def test_a_result_refused_while_stored_costs_the_others_nothing(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = _controller(tiny_model, tmp_path)
    t = grant(c, 3)
    poisoned = t[1].task_id

    def poison(real: Any) -> Any:
        def insert(task_id: int, *args: Any, **kw: Any) -> Any:
            out = real(task_id, *args, **kw)
            if task_id == poisoned:  # fault injection: refused after earlier results of the group were stored
                raise RefusedResult("advantages are not finite (injected)")
            return out

        return insert

    # a message's results are stored from its columns; each result alone from its sequences
    monkeypatch.setattr(c.buffer, "insert_columns", poison(c.buffer.insert_columns))
    monkeypatch.setattr(c.buffer, "insert", poison(c.buffer.insert))
    results = [m.Outcome(task_id=x.task_id, epoch=x.epoch, episodes=_episodes(x.task_id)) for x in t]
    acks = c.dispatch(b"w", m.TaskResults.of(results))[0][1]
    assert isinstance(acks, m.ResultsAck)
    assert [a.status for a in acks.acks] == ["accepted", "invalid", "accepted"]
    assert "injected" in acks.acks[1].message
    assert sorted({r[1] for r in stored(c)}) == [t[0].task_id, t[2].task_id]
    assert len(stored(c)) == 2 * GROUP


def test_results_per_message_are_capped() -> None:
    from astraflow.protocol.codec import DecodeError, decode, encode

    one = m.Outcome(task_id=1, epoch=1)
    assert isinstance(decode(encode(m.TaskResults.of([one] * m.MAX_RESULTS))), m.TaskResults)
    with pytest.raises(DecodeError):
        decode(encode(m.TaskResults.of([one] * (m.MAX_RESULTS + 1))))

"""A TaskResults carries its sequences as columns (protocol/columns.py): they come back exactly as
sent, a message whose columns do not fit together is refused whole with nothing stored and its
leases kept, and a faulty sequence is still named exactly (driven through Controller.dispatch on a
real state.db, no sockets)."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from astraflow.protocol import columns
from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError, decode, encode
from astraflow.protocol.columns import ResultColumns
from tests.dispatch_controller import grant, stored
from tests.unit.test_group_commit import _controller, _episodes


def _seq(policy: str, tokens: list[int], **kw: object) -> m.Sequence:
    n = len(tokens)
    return m.Sequence(
        policy=policy,
        tokens=tokens,
        loss_mask=[0] + [1] * (n - 1),
        logprobs=[0.0] + [-0.5] * (n - 1),
        versions=[-1] + [0] * (n - 1),
        sampling=m.SamplingParams(temperature=0.7 if policy == "b" else 1.0),
        **kw,  # type: ignore[arg-type]
    )


def test_columns_give_back_every_result_as_sent() -> None:
    outcomes = [
        m.Outcome(
            task_id=1,
            epoch=2,
            episodes=[
                m.Episode(
                    sequences=[
                        _seq("a", [5, 6, 7], reward=1.5, role="solver", group_key="x"),
                        _seq("b", [9, 8], role="judge", turns=[(1, 1, False)]),
                    ],
                    info={"correct": 1, "note": "ok"},
                ),
                m.Episode(sequences=[_seq("a", [1, 2, 3, 4], reward=-0.25, group_key="y")]),
            ],
        ),
        m.Outcome(task_id=3, epoch=1, error="boom"),
        m.Outcome(task_id=4, epoch=1, episodes=[m.Episode(sequences=[_seq("b", [3, 3], reward=2.0)])]),
    ]
    msg = decode(encode(m.TaskResults.of(outcomes, rid=9)))
    assert isinstance(msg, m.TaskResults) and msg.rid == 9
    view = ResultColumns(msg)
    assert view.problem == ""
    assert [encode(view.outcome(i)) for i in range(3)] == [encode(o) for o in outcomes]
    assert [view.span(i) for i in range(3)] == [(0, 3), (3, 3), (3, 4)]


def test_messages_joined_by_their_columns_give_back_every_result_as_sent() -> None:
    """columns.join (a poll's small TaskResults taken as one: coalesce.py): each message's tables
    differ, so its index columns must be mapped into the joined ones, and its turns moved."""
    rng = random.Random(5)
    outcomes: list[m.Outcome] = []
    messages: list[m.TaskResults] = []
    for k in range(9):
        mine = []
        for j in range(rng.randint(1, 3)):
            if rng.random() < 0.15:
                mine.append(m.Outcome(task_id=100 * k + j, epoch=1, error="boom"))
                continue
            episodes = []
            for e in range(rng.randint(1, 2)):
                seqs = [
                    _seq(
                        rng.choice("abc"),
                        [rng.randrange(50) for _ in range(rng.randint(2, 6))],
                        reward=rng.choice([0.0, 1.0, -0.5]),
                        role=rng.choice(["", "solver", "judge"]),
                        group_key=rng.choice(["", "x", f"k{k}"]),
                        turns=[(1, 1, False)] if rng.random() < 0.3 else None,
                    )
                    for _ in range(rng.randint(0, 3))
                ]
                episodes.append(m.Episode(sequences=seqs, info={"n": e} if rng.random() < 0.3 else {}))
            mine.append(m.Outcome(task_id=100 * k + j, epoch=2, episodes=episodes))
        outcomes += mine
        messages.append(decode(encode(m.TaskResults.of(mine))))
    joined = decode(encode(columns.join([ResultColumns(x) for x in messages], rid=4)))
    assert isinstance(joined, m.TaskResults) and joined.rid == 4
    view = ResultColumns(joined)
    assert view.problem == "" and len({n for x in messages for n in x.columns.names}) > 2
    assert [encode(view.outcome(i)) for i in range(len(outcomes))] == [encode(o) for o in outcomes]


def test_uniform_says_per_result_whether_a_column_holds_one_value() -> None:
    """`ResultColumns.uniform` (one numpy pass per message) against each result's values read one
    by one, over results of one value, of a change at their first, middle and last sequence, empty
    ones and errors, next to neighbours of the same and of other values."""
    specs = [
        [("a", "x")] * 3,
        [("a", "x"), ("b", "x"), ("a", "x")],
        [],
        [("a", "y")],
        [("a", "y"), ("a", "y"), ("a", "z")],
        [("b", "z"), ("a", "z")],
        [("b", "z")] * 2,
    ]
    outcomes = []
    for t, spec in enumerate(specs):
        if not spec:
            outcomes.append(m.Outcome(task_id=t, epoch=1, error="boom"))
            continue
        seqs = [_seq(pol, [1, 2], group_key=key) for pol, key in spec]
        outcomes.append(m.Outcome(task_id=t, epoch=1, episodes=[m.Episode(sequences=seqs)]))
    view = ResultColumns(decode(encode(m.TaskResults.of(outcomes))))  # type: ignore[arg-type]
    assert view.problem == ""
    for name, at in (("policy", 0), ("key", 1)):
        want = [len({s[at] for s in spec}) <= 1 for spec in specs]
        assert view.uniform(name) == want, name
    assert view.uniform("role") == [True] * len(specs)


def test_bad_columns_are_refused_whole_and_lose_nothing(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    tasks = grant(c, 2)
    good = m.TaskResults.of(
        [m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t.task_id)) for t in tasks]
    )
    cols = good.columns
    for bad in (
        msgspec.structs.replace(cols, tokens=cols.tokens[:-4]),
        msgspec.structs.replace(cols, policy=b"\x07\x00\x00\x00" + cols.policy[4:]),
        msgspec.structs.replace(cols, lengths=cols.lengths[:-4]),
        msgspec.structs.replace(cols, turns={99: [(0, 1, False)]}),
    ):
        reply = c.dispatch(b"w", decode(encode(msgspec.structs.replace(good, columns=bad))))[0][1]
        assert isinstance(reply, m.Error) and reply.code == "bad_result", reply
        assert reply.message.startswith("TaskResults columns: ") and "nothing stored" in reply.message
        assert stored(c) == []
        assert [
            r["status"]
            for r in c.store.query(
                "SELECT status FROM tasks WHERE id IN (?, ?)", tuple(t.task_id for t in tasks)
            )
        ] == ["leased", "leased"]
    acks = c.dispatch(b"w", decode(encode(good)))[0][1]
    assert isinstance(acks, m.ResultsAck) and [a.status for a in acks.acks] == ["accepted", "accepted"]
    assert len(stored(c)) == 2 * len(_episodes(0))


def test_a_faulty_sequence_is_still_named_exactly(tiny_model: Path, tmp_path: Path) -> None:
    c = _controller(tiny_model, tmp_path)
    tasks = grant(c, 3)
    results = [m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t.task_id)) for t in tasks]
    results[1] = m.Outcome(
        task_id=tasks[1].task_id,
        epoch=tasks[1].epoch,
        episodes=_episodes(tasks[1].task_id)[:1] + _episodes(0, 10**6)[:1],
    )
    acks = c.dispatch(b"w", decode(encode(m.TaskResults.of(results))))[0][1]
    assert isinstance(acks, m.ResultsAck)
    assert [a.status for a in acks.acks] == ["accepted", "invalid", "accepted"]
    assert "episode 1 sequence 0: token id 1000000 outside the vocabulary" in acks.acks[1].message
    assert {row[1] for row in stored(c)} == {tasks[0].task_id, tasks[2].task_id}


def test_arrays_of_different_lengths_travel_as_the_error_naming_them() -> None:
    odd = m.Sequence(
        policy="a",
        tokens=[1, 2, 3, 4],
        loss_mask=[0, 1, 1],
        logprobs=[0.0] * 4,
        versions=[0] * 4,
        sampling=m.SamplingParams(),
    )
    fine = m.Episode(sequences=[_seq("a", [1, 2])])
    msg = m.TaskResults.of([m.Outcome(task_id=5, epoch=1, episodes=[fine, m.Episode(sequences=[odd])])])
    (head,) = msg.results
    assert (
        head.error
        == "invalid result: episode 1 sequence 0: tokens/loss_mask/logprobs/versions lengths differ (4/3/4/4)"
    )
    assert head.episodes == [] and msg.columns.lengths == b""


def test_a_peer_of_the_previous_protocol_is_refused_and_its_results_do_not_decode(
    tiny_model: Path, tmp_path: Path
) -> None:
    c = _controller(tiny_model, tmp_path)
    old = m.Hello(member_id="old", role="raas", protocol=6, policies=["main"], pid=2, host="h")
    reply = c.dispatch(b"old", old)[0][1]
    assert isinstance(reply, m.Error) and reply.code == "protocol_version"
    assert f"controller speaks protocol {m.PROTOCOL_VERSION}, member 6" in reply.message
    # a version-6 TaskResults (Outcomes of PackedEpisodes, no columns) is not a version-7 one
    v6 = msgspec.msgpack.encode(
        {"type": "TaskResults", "rid": 1, "results": [{"task_id": 1, "epoch": 1, "episodes": []}]}
    )
    with pytest.raises(DecodeError):
        decode(v6)


@pytest.mark.parametrize("bad", [-1, 2, 1 << 31 - 1])
def test_an_index_outside_its_table_is_a_problem_of_the_message(bad: int) -> None:
    import numpy as np

    msg = m.TaskResults.of(
        [m.Outcome(task_id=1, epoch=1, episodes=[m.Episode(sequences=[_seq("a", [1, 2])] * 3)])]
    )
    assert ResultColumns(msg).problem == "" and len(msg.columns.names) == 2  # "a" and the role ""
    for col in ("policy", "role", "group_key", "sampling"):
        table = {"policy": 2, "role": 2, "group_key": 1, "sampling": 1}[col]
        good = getattr(msg.columns, col)
        values = np.frombuffer(good, "<i4").copy()
        values[1] = bad if bad != 2 else table  # the first index past the table
        setattr(msg.columns, col, values.tobytes())
        assert (
            ResultColumns(msg).problem
            == f"TaskResults columns: {col} holds an index outside its table of {table}"
        )
        setattr(msg.columns, col, good)
    assert ResultColumns(msg).problem == ""

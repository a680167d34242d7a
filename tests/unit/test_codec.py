"""The wire codec: every message round-trips; unknown types, unknown fields and garbage are rejected."""

from __future__ import annotations

import typing

import msgspec
import pytest

from astraflow.protocol import messages as m
from astraflow.protocol import sample_columns
from astraflow.protocol.codec import MESSAGE_TYPES, DecodeError, decode, encode

_TASK = m.Task(task_id=3, epoch=2, sample={"prompt": "1+1", "answer": 2}, group_size=4, roles={"solver": "p"})
_SEQ = m.Sequence(
    policy="p",
    tokens=[1, 2, 3],
    loss_mask=[0, 1, 1],
    logprobs=[0.0, -0.5, -1.0],
    versions=[-1, 4, 5],
    reward=1.0,
    sampling=m.SamplingParams(),
)
_VI = m.VersionInfo(policy="p", version=7, weights_addr="tcp://127.0.0.1:5000", sha256="ab" * 32)
_TS = m.TrainSample(
    traj_id=9,
    tokens=[1, 2],
    loss_mask=[0, 1],
    logprobs=[0.0, -0.1],
    versions=[-1, 3],
    reward=0.5,
    advantage=-0.25,
    sampling=m.SamplingParams(),
)

SAMPLES: list[m.Msg] = [
    m.Hello(
        rid=1, member_id="raas-a", role="raas", protocol=m.PROTOCOL_VERSION, policies=["p"], slots=8, pid=42
    ),
    m.Welcome(rid=1, run_name="r", sections={"seed": 3}, heartbeat_interval_s=0.5, versions=[_VI]),
    m.Heartbeat(rid=2, loaded={"p": 7}, busy=1, free=3),
    m.HeartbeatAck(rid=2, versions=[_VI], stop=True),
    m.Bye(rid=3, reason="done"),
    m.Leave(rid=3, member_id="raas-1"),
    m.Control(rid=4, action="pause", policy="main"),
    m.TaskRequest(rid=4, n=2, loaded={"p": 7}),
    m.TaskGrant(rid=4, tasks=[_TASK], versions=[_VI], retry_after_s=0.0),
    m.TaskResult(rid=5, task_id=3, epoch=2, episodes=[m.Episode(sequences=[_SEQ], info={"correct": 1.0})]),
    m.ResultAck(rid=5, task_id=3, status="accepted"),
    m.TaskResults.of([m.Outcome(task_id=3, epoch=2, episodes=[m.Episode(sequences=[_SEQ])])], rid=6),
    m.ResultsAck(rid=6, acks=[m.OutcomeAck(task_id=3, status="invalid", code="bad_result", message="why")]),
    m.BatchRequest(rid=6, policy="p", step=1),
    m.BatchReply(rid=6, policy="p", step=1, columns=sample_columns.pack([_TS]), ready=True),
    m.VersionPublished(
        rid=7, policy="p", version=8, step=8, weights_addr="tcp://h:1", nbytes=10, metrics={"loss": 0.1}
    ),
    m.Ack(rid=7, detail="ok"),
    m.Error(rid=8, code="bad_message", message="nope"),
    m.StatusRequest(rid=9),
    m.StatusReply(rid=9, status={"policies": []}),
    m.WeightRequest(rid=10, policy="p", version=8, chunk=2, kind="delta"),
    m.WeightManifest(
        rid=10, policy="p", version=8, nbytes=5, chunk_bytes=4, chunk_sha256=["a", "b"], sha256="c"
    ),
    m.WeightChunk(rid=11, policy="p", version=8, index=1, nbytes=5),
]


def test_samples_cover_every_message_type() -> None:
    assert {type(s).__name__ for s in SAMPLES} == MESSAGE_TYPES
    assert MESSAGE_TYPES == {c.__name__ for c in typing.get_args(m.Message)}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg: m.Msg) -> None:
    data = encode(msg)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__


def test_unknown_type_rejected_with_code_and_rid() -> None:
    data = msgspec.msgpack.encode({"type": "Pickle", "rid": 17, "payload": b"x"})
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.code == "unknown_type"
    assert info.value.rid == 17


def test_unknown_field_rejected() -> None:
    data = msgspec.msgpack.encode({"type": "Bye", "rid": 4, "reason": "x", "extra": 1})
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.code == "bad_message"
    assert info.value.rid == 4


def test_wrong_field_type_and_missing_field_rejected() -> None:
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode({"type": "TaskRequest", "rid": 1, "n": "many"}))
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode({"type": "TaskRequest", "rid": 1}))
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode({"rid": 1, "n": 2}))  # no tag


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\xc1",
        b"\x00\xff\xfe",
        b"\x93\x01\x02\x03",
        b"\xdf\xff\xff\xff\xff",
        b"\x91" * 100_000,
        b"GET / HTTP/1.1\r\n",
    ],
)
def test_garbage_rejected_without_crashing(garbage: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        decode(garbage)
    assert info.value.code == "bad_message"
    assert info.value.rid == 0


def test_bogus_rid_not_echoed() -> None:
    for rid in (True, -1, 1 << 63, "7"):
        with pytest.raises(DecodeError) as info:
            decode(msgspec.msgpack.encode({"type": "Nope", "rid": rid}))
        assert info.value.rid == 0

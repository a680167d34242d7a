"""The codec on the inputs that used to escape it, and the field caps of messages.py."""

from __future__ import annotations

import msgspec
import pytest

from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError, decode, encode, peek_rid


@pytest.mark.parametrize(
    "data",
    [
        b"\xa1\xff",  # a msgpack string that is not UTF-8 (killed the controller through the diagnosis)
        b"\x82\xa4type\xa5Hell\xff\xa3rid\x05",
        b"\x91" * 10_000 + b"\x00",  # arrays nested 10,000 deep
        b"\x81\xa1k" * 10_000 + b"\x00",  # maps nested 10,000 deep
        b"\x83\xa4type\xa5Hello\xa3rid\x01\xa6policy" + b"\x91" * 10_000 + b"\x00",
        b"\xdb\xff\xff\xff\xff",  # declares a 4 GiB string
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"",
    ],
)
def test_anything_fails_as_decode_error_only(data: bytes) -> None:
    with pytest.raises(DecodeError) as err:
        decode(data)
    assert err.value.code == "bad_message"


def test_rid_and_unknown_type_survive_diagnosis() -> None:
    with pytest.raises(DecodeError) as err:
        decode(msgspec.msgpack.encode({"type": "Nope", "rid": 41, "x": [[[1]]]}))
    assert (err.value.code, err.value.rid) == ("unknown_type", 41)
    assert peek_rid(msgspec.msgpack.encode({"type": "Hello", "rid": 7, "member_id": 3})) == 7
    assert peek_rid(b"\xa1\xff") == 0


def _hello(**kw: object) -> bytes:
    base: dict[str, object] = {
        "type": "Hello",
        "rid": 1,
        "member_id": "raas-1",
        "role": "raas",
        "protocol": 1,
    }
    return msgspec.msgpack.encode({**base, **kw})


@pytest.mark.parametrize(
    "field",
    [
        {"member_id": "x" * 256},
        {"member_id": ""},
        {"host": "h" * 100_000},
        {"hardware": "h" * 256},
        {"region": "r" * 129},
        {"policies": ["p"] * 65},
        {"policies": ["p" * 256]},
        {"slots": -1},
        {"role": "r" * 33},
    ],
)
def test_hello_fields_are_capped(field: dict[str, object]) -> None:
    decode(_hello())  # the base is valid
    with pytest.raises(DecodeError):
        decode(_hello(**field))


def test_episode_info_holds_scalars_only() -> None:
    seq = m.Sequence(
        policy="p", tokens=[1], loss_mask=[1], logprobs=[0.0], versions=[0], sampling=m.SamplingParams()
    )
    ok = m.TaskResult(
        task_id=1, epoch=1, episodes=[m.Episode(sequences=[seq], info={"a": 1, "b": "x", "c": None})]
    )
    assert decode(encode(ok)) == ok
    raw = msgspec.msgpack.decode(encode(ok))
    raw["episodes"][0]["info"] = {"nested": {"deeper": [1, 2]}}
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode(raw))

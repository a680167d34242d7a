"""Malformed control-plane frames: what tests/security's fuzz test and `astraflow bench wire` send."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgspec

from astraflow.protocol import messages as m
from astraflow.protocol.codec import encode

_VALID: list[m.Msg] = [
    m.Hello(member_id="raas-x", role="raas", protocol=m.PROTOCOL_VERSION, policies=["main"], slots=2),
    m.Heartbeat(loaded={"main": 0}, busy=1, free=1),
    m.TaskRequest(n=2),
    m.TaskResult(
        task_id=1,
        epoch=1,
        episodes=[
            m.Episode(
                sequences=[
                    m.Sequence(
                        policy="main",
                        tokens=[1, 2],
                        loss_mask=[0, 1],
                        logprobs=[0, -1.0],
                        versions=[-1, 0],
                        sampling=m.SamplingParams(),
                    )
                ]
            )
        ],
    ),
    m.BatchRequest(policy="main", step=1),
    m.VersionPublished(policy="main", version=1, step=1, weights_addr="tcp://127.0.0.1:1"),
    m.WeightRequest(policy="main", version=1, chunk=0),
]


def _deep(depth: int, kind: int) -> bytes:
    """A msgpack value nested `depth` deep, inside a Hello-shaped map."""
    inner = (b"\x91" * depth if kind == 0 else b"\x81\xa1k" * depth) + b"\x00"
    return b"\x83\xa4type\xa5Hello\xa3rid\x01\xa6policy" + inner


_HUGE = [
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xdd\xff\xff\xff\xff",  # array32
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
]


def malformed_frames(n: int, seed: int = 0) -> Iterator[list[bytes]]:
    """n malformed multipart messages (lists of frames), cycling through every family of bad input."""
    rng = random.Random(seed)
    valid = [encode(v) for v in _VALID]
    for i in range(n):
        family = i % 13
        if family == 0:
            yield [rng.randbytes(rng.randrange(0, 64))]
        elif family == 1:
            yield [rng.randbytes(rng.randrange(64, 2048))]
        elif family == 2:  # invalid UTF-8 where a string is expected, alone and as a tag or field
            yield [
                rng.choice(
                    [
                        b"\xa1\xff",
                        b"\x82\xa4type\xa5Hell\xff\xa3rid\x01",
                        b"\x82\xa4type\xa5Hello\xa9member_id" + b"\xa2\xc3\x28",
                        b"\x81\xa2\xfe\xfe\x01",
                    ]
                )
            ]
        elif family == 3:  # truncated valid messages
            v = rng.choice(valid)
            yield [v[: rng.randrange(0, len(v))]]
        elif family == 4:  # right tag, wrong shapes
            tag = rng.choice(sorted({type(v).__name__ for v in _VALID}))
            junk: Any = rng.choice([123, -1, "x" * 10, [1, 2, 3], {"a": 1}, None, 1.5, True, b"\x00"])
            field = rng.choice(["member_id", "rid", "policy", "n", "episodes", "loaded", "chunk", "slots"])
            yield [msgspec.msgpack.encode({"type": tag, "rid": i, field: junk})]
        elif family == 5:  # unknown tags
            yield [msgspec.msgpack.encode({"type": f"Nope{i % 97}", "rid": i})]
        elif family == 6:  # deep nesting (rare: each is ~10-30 KB)
            yield [_deep(10_000, i % 2)] if i % 130 == 6 else [msgspec.msgpack.encode([[[[[i]]]]])]
        elif family == 7:  # huge declared lengths, alone or inside a message
            h = rng.choice(_HUGE)
            yield [h if rng.random() < 0.5 else b"\x82\xa4type\xa5Hello\xa9member_id" + h]
        elif family == 8:  # many-frame messages
            yield [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(2, 64))]
        elif family == 9:  # bit flips in valid messages
            flipped = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            yield [bytes(flipped)]
        elif family == 10:  # fields past their caps (rare: ~100 KB)
            if i % 130 == 10:
                yield [
                    msgspec.msgpack.encode(
                        {"type": "Hello", "rid": i, "member_id": "x" * 100_000, "role": "raas", "protocol": 1}
                    )
                ]
            else:
                yield [
                    msgspec.msgpack.encode(
                        {"type": "Hello", "rid": i, "policies": ["p"] * 100, "protocol": 1}
                    )
                ]
        elif family == 11:  # empty and near-empty frames, odd containers
            yield [rng.choice([b"", b"\xc0", b"\x80", b"\x90", b"\xc1", b"\xff" * 8, b"\x81\xc0\xc0"])]
        else:  # unknown fields on a valid message
            yield [msgspec.msgpack.encode({"type": "Heartbeat", "rid": i, "evil": rng.randbytes(8)})]

"""Malformed control-plane frames: what tests/security's fuzz test and `astraflow bench wire` send."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
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
        episodes=m.pack_episodes(
            [
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
            ]
        ),
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


def _random_short(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    return [rng.randbytes(rng.randrange(0, 64))]


def _random_long(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    return [rng.randbytes(rng.randrange(64, 2048))]


def _bad_utf8(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    """Invalid UTF-8 where a string is expected, alone and as a tag or field."""
    return [
        rng.choice(
            [
                b"\xa1\xff",
                b"\x82\xa4type\xa5Hell\xff\xa3rid\x01",
                b"\x82\xa4type\xa5Hello\xa9member_id" + b"\xa2\xc3\x28",
                b"\x81\xa2\xfe\xfe\x01",
            ]
        )
    ]


def _truncated(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    v = rng.choice(valid)
    return [v[: rng.randrange(0, len(v))]]


def _wrong_shapes(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    """The right tag with a field of the wrong type."""
    tag = rng.choice(sorted({type(v).__name__ for v in _VALID}))
    junk: Any = rng.choice([123, -1, "x" * 10, [1, 2, 3], {"a": 1}, None, 1.5, True, b"\x00"])
    field = rng.choice(["member_id", "rid", "policy", "n", "episodes", "loaded", "chunk", "slots"])
    return [msgspec.msgpack.encode({"type": tag, "rid": i, field: junk})]


def _unknown_tag(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    return [msgspec.msgpack.encode({"type": f"Nope{i % 97}", "rid": i})]


def _deep_nesting(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    """Rare: each is ~10-30 KB."""
    return [_deep(10_000, i % 2)] if i % 130 == 6 else [msgspec.msgpack.encode([[[[[i]]]]])]


def _huge_length(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    """A huge declared length, alone or inside a message."""
    h = rng.choice(_HUGE)
    return [h if rng.random() < 0.5 else b"\x82\xa4type\xa5Hello\xa9member_id" + h]


def _many_frames(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    return [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(2, 64))]


def _bit_flips(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    flipped = bytearray(rng.choice(valid))
    for _ in range(rng.randrange(1, 4)):
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    return [bytes(flipped)]


def _past_caps(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    """Fields past their caps (rare: ~100 KB)."""
    if i % 130 == 10:
        msg: dict[str, Any] = {
            "type": "Hello",
            "rid": i,
            "member_id": "x" * 100_000,
            "role": "raas",
            "protocol": 1,
        }
    else:
        msg = {"type": "Hello", "rid": i, "policies": ["p"] * 100, "protocol": 1}
    return [msgspec.msgpack.encode(msg)]


def _near_empty(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    """Empty and near-empty frames, odd containers."""
    return [rng.choice([b"", b"\xc0", b"\x80", b"\x90", b"\xc1", b"\xff" * 8, b"\x81\xc0\xc0"])]


def _unknown_field(rng: random.Random, i: int, valid: list[bytes]) -> list[bytes]:
    return [msgspec.msgpack.encode({"type": "Heartbeat", "rid": i, "evil": rng.randbytes(8)})]


_FAMILIES: list[Callable[[random.Random, int, list[bytes]], list[bytes]]] = [
    _random_short,
    _random_long,
    _bad_utf8,
    _truncated,
    _wrong_shapes,
    _unknown_tag,
    _deep_nesting,
    _huge_length,
    _many_frames,
    _bit_flips,
    _past_caps,
    _near_empty,
    _unknown_field,
]
"""Each family of bad input: (rng, message index, encoded valid messages) -> the message's frames."""


def malformed_frames(n: int, seed: int = 0) -> Iterator[list[bytes]]:
    """n malformed multipart messages (lists of frames), cycling through every family of bad input."""
    rng = random.Random(seed)
    valid = [encode(v) for v in _VALID]
    for i in range(n):
        yield _FAMILIES[i % len(_FAMILIES)](rng, i, valid)

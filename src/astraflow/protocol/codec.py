"""Encode and decode messages: msgspec bytes <-> typed structs. Nothing else ever crosses the wire.

Decoding never raises anything but DecodeError, whatever the bytes: invalid UTF-8, truncated data,
declared lengths beyond the frame, nesting past the decoder's recursion guard, wrong shapes and
unknown tags all end as a DecodeError carrying the Error code to answer with. Sizes are bounded
before any work is done on a message: the transport caps the frame (zmq MAXMSGSIZE), msgspec checks
every declared length against the bytes left, and the message structs cap strings and lists
(msgspec.Meta constraints in messages.py), so no field can hold more than the protocol allows.
"""

from __future__ import annotations

import typing

import msgspec

from astraflow.protocol.messages import Message, Msg

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)

MESSAGE_TYPES: frozenset[str] = frozenset(cls.__name__ for cls in typing.get_args(Message))
"""The tag ("type" field) of every message this protocol version knows."""


class _Probe(msgspec.Struct):
    """The two fields a rejected frame is diagnosed by; everything else in it is skipped unread."""

    type: str = ""
    rid: int = 0


_probe = msgspec.msgpack.Decoder(_Probe)


class DecodeError(Exception):
    """Bytes that are not a valid message of this protocol.

    `code` is the Error code a receiver should answer with ("bad_message" or "unknown_type") and
    `rid` the request id recovered from the bytes when they were at least a msgpack map (else 0),
    so the sender's pending request can be failed instead of timing out.
    """

    def __init__(self, message: str, *, code: str = "bad_message", rid: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.rid = rid


def encode(msg: Msg) -> bytes:
    """Serialize a message to msgpack."""
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Msg:
    """Parse and validate msgpack bytes into a message struct, or raise DecodeError (never anything else)."""
    try:
        return _decoder.decode(data)
    except Exception as exc:  # UnicodeDecodeError and RecursionError escape msgspec's own types
        reason = str(exc)[:300] or type(exc).__name__
    code, rid = _diagnose(data)
    raise DecodeError(reason, code=code, rid=rid)


def _diagnose(data: bytes | memoryview) -> tuple[str, int]:
    """Best-effort error code and rid of bytes the typed decoder rejected; never raises."""
    try:
        probe = _probe.decode(data)
    except Exception:  # not a map, or its type/rid are unreadable: nothing to recover
        return "bad_message", 0
    # a rid must be a plain non-negative int that fits an int64
    rid = probe.rid if 0 <= probe.rid < 1 << 63 else 0
    code = "unknown_type" if probe.type and probe.type not in MESSAGE_TYPES else "bad_message"
    return code, rid


def peek_rid(data: bytes | memoryview) -> int:
    """The rid of a frame if it is a msgpack map with a plain int rid, else 0; never raises."""
    return _diagnose(data)[1]

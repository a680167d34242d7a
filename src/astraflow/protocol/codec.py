"""Encode and decode messages: msgpack bytes <-> typed structs. Nothing else ever crosses the wire."""

from __future__ import annotations

import typing

import msgspec

from astraflow.protocol.messages import Message, Msg

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_lenient = msgspec.msgpack.Decoder()

MESSAGE_TYPES: frozenset[str] = frozenset(cls.__name__ for cls in typing.get_args(Message))
"""The tag ("type" field) of every message this protocol version knows."""


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
    """Parse and validate msgpack bytes into a message struct, or raise DecodeError."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        code, rid = _diagnose(data)
        raise DecodeError(str(exc), code=code, rid=rid) from None


def _diagnose(data: bytes | memoryview) -> tuple[str, int]:
    """Best-effort error code and rid of bytes the typed decoder rejected."""
    try:
        raw = _lenient.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return "bad_message", 0
    if not isinstance(raw, dict):
        return "bad_message", 0
    rid = raw.get("rid", 0)
    # bool is an int subclass; a rid must be a plain non-negative int that fits an int64
    if type(rid) is not int or not 0 <= rid < 1 << 63:
        rid = 0
    tag = raw.get("type")
    code = "unknown_type" if isinstance(tag, str) and tag not in MESSAGE_TYPES else "bad_message"
    return code, rid

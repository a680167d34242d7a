"""Encode and decode messages: msgpack bytes <-> typed structs. Nothing else ever crosses the wire."""

from __future__ import annotations

import msgspec

from astraflow.protocol.messages import Message, Msg

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class DecodeError(Exception):
    """Bytes that are not a valid message of this protocol."""


def encode(msg: Msg) -> bytes:
    """Serialize a message to msgpack."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Msg:
    """Parse and validate msgpack bytes into a message struct, or raise DecodeError."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(str(exc)) from None

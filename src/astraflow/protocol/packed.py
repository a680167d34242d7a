"""Per-token data as packed little-endian arrays: the form it travels and is stored in.

A sequence's tokens and versions are int32, its loss mask uint8 and its behaviour logprobs float32,
each one bytes object (docs/protocol.md "Packed per-token arrays"). Workflows build `Sequence` with
Python lists; the RaaS packs them once (`messages.PackedSequence.of`), the controller checks the
arrays with numpy and stores the bytes as they came, and the trainer turns them into tensors with
one copy. Packing refuses a value its type cannot hold (a token id past 2**31 - 1, a mask value
outside 0..255) with a ValueError naming the field, never wraps it.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

INT32 = "<i4"
"""numpy dtype of tokens and versions."""
UINT8 = "|u1"
"""numpy dtype of the loss mask."""
FLOAT32 = "<f4"
"""numpy dtype of the behaviour logprobs."""
ITEM_BYTES = {"tokens": 4, "loss_mask": 1, "logprobs": 4, "versions": 4}
"""Bytes per token of each packed field."""

_SWAP = sys.byteorder == "big"
assert array("i").itemsize == 4 and array("f").itemsize == 4, "int and float of this platform are not 32-bit"


def _packed(a: array[Any]) -> bytes:
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def pack_ints(field: str, values: Any) -> bytes:
    """int32 little-endian bytes of these integers (ValueError naming `field` when one does not fit)."""
    try:
        return _packed(array("i", values))
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"{field}: {exc} (packed as int32)") from None


def pack_mask(values: Any) -> bytes:
    """uint8 bytes of a loss mask (ValueError when a value is outside 0..255)."""
    try:
        return bytes(values)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"loss_mask: {exc} (packed as uint8)") from None


def pack_floats(field: str, values: Any) -> bytes:
    """float32 little-endian bytes of these numbers (a float64 rounds to the nearest float32; beyond its
    range it becomes an infinity, which the controller refuses like any non-finite logprob)."""
    try:
        return _packed(array("f", values))
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"{field}: {exc} (packed as float32)") from None


def _unpacked(code: str, data: bytes) -> array[Any]:
    a = array(code)
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a


def ints(data: bytes) -> list[int]:
    """The integers of int32 little-endian bytes (a length that is not a multiple of 4: ValueError)."""
    return _unpacked("i", data).tolist()


def floats(data: bytes) -> list[float]:
    """The numbers of float32 little-endian bytes, as Python floats (a length not a multiple of 4: ValueError)."""
    return _unpacked("f", data).tolist()


def layout_problem(tokens: bytes, loss_mask: bytes, logprobs: bytes, versions: bytes) -> str:
    """Why four packed fields are not one sequence's arrays ('' when their sizes fit): a size that is
    not a whole number of items, or arrays of different lengths."""
    if type(tokens) is type(loss_mask) is type(logprobs) is type(versions) is bytes and not (
        len(tokens) & 3 or len(logprobs) & 3 or len(versions) & 3
    ):
        return ""  # what a decoded message holds: checked without a dict and a loop a sequence
    sizes = {"tokens": tokens, "loss_mask": loss_mask, "logprobs": logprobs, "versions": versions}
    for name, data in sizes.items():
        if not isinstance(data, bytes | bytearray | memoryview):
            return f"{name} is {type(data).__name__}, not packed bytes"
        if len(data) % ITEM_BYTES[name]:
            return f"{name} is {len(data)} bytes, not a whole number of {ITEM_BYTES[name]}-byte items"
    return ""


def length(tokens: bytes) -> int:
    """Tokens in an int32 array."""
    return len(tokens) // 4

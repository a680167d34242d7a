"""A task's JSON columns: its sample written as `json.dumps(sample, sort_keys=True)` writes it and
read back as `json.loads` reads it, its role map and read-only list parsed once per distinct text."""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

import msgspec

_decode = msgspec.json.Decoder().decode

_parsed: dict[str, Any] = {}
"""Role maps and read-only lists as stored -> parsed: a run has a handful of distinct ones, and every
task row carries one of them."""


def parsed(text: str) -> Any:
    """A stored role map or read-only list, parsed (a fresh copy: a task's own is never shared)."""
    value = _parsed.get(text)
    if value is None:
        value = json.loads(text)
        if len(_parsed) < 1024:
            _parsed[text] = value
    return value.copy()


def sample_of(text: str) -> dict[str, Any]:
    """A sample as `json.loads` parses the stored text, parsed by msgspec (several times faster);
    text msgspec refuses (NaN and Infinity, which json.dumps writes, a lone surrogate, nesting past
    its depth) is parsed by `json.loads` itself. Both give the same values, types, key order and
    floats on the texts tests/unit/test_lease_one_pass.py tries (random floats over the whole range,
    integers past 64 bits, nested values, the odd ones)."""
    try:
        out: dict[str, Any] = _decode(text)
    except (msgspec.DecodeError, RecursionError):
        out = json.loads(text)
    return out


def sorted_dumps() -> Callable[[Any], str]:
    """`json.dumps(obj, sort_keys=True)` for the samples of one call: the C encoder json.dumps builds
    for every call (its circular-reference check included), built once for them all."""
    enc = json.JSONEncoder(sort_keys=True)
    if c_make_encoder is None:
        return enc.encode
    # json.dumps's own arguments: a fresh markers dict (the circular check), ensure_ascii, no
    # indent, its separators, sort_keys, no skipkeys, allow_nan
    once = c_make_encoder(
        {},
        enc.default,
        encode_basestring_ascii,
        None,
        enc.key_separator,
        enc.item_separator,
        True,
        False,
        True,
    )

    def dumps(obj: Any) -> str:
        return "".join(once(obj, 0)) if isinstance(obj, dict) else enc.encode(obj)

    return dumps

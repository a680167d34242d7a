"""Lossless weight deltas: bit-exact round trips, refusal of deltas that do not fit, relay choice."""

from __future__ import annotations

import hashlib

import pytest
import torch

from astraflow.weights.delta import DeltaError, apply_delta, encode_delta, read_header
from astraflow.weights.relay import RelayDirectory
from astraflow.weights.snapshot import bytes_to_state_dict, state_dict_to_bytes


def _sha(blob: bytes | memoryview) -> str:
    return hashlib.sha256(blob).hexdigest()


def _odd_bits(dtype: torch.dtype, n: int) -> torch.Tensor:
    """Values whose bit patterns matter: +0/-0, NaNs with different payloads, infinities."""
    width = {2: torch.int16, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    t = torch.randn(n).to(dtype)
    t[0], t[1], t[2], t[3] = 0.0, -0.0, float("inf"), float("-inf")
    t[4] = float("nan")
    bits = t.view(width)
    bits[5] = bits[4] | 1  # another NaN payload
    return t


def _pair(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    base = {
        "sparse": torch.randn(300, 200).to(dtype),
        "odd": _odd_bits(dtype, 64),
        "same": torch.randn(50).to(dtype),
        "all": torch.randn(40).to(dtype),
    }
    target = {k: v.clone() for k, v in base.items()}
    mask = torch.rand(300, 200) < 0.01
    target["sparse"][mask] += 1
    target["sparse"][-1, -1] += 1  # the last element: the index range's end
    width = {2: torch.int16, 4: torch.int32}[base["odd"].element_size()]
    ob = target["odd"].view(width)
    ob[0], ob[1] = ob[1].clone(), ob[0].clone()  # +0 <-> -0: equal as floats, different bits
    ob[4] = ob[4] ^ 2  # a NaN that stays NaN with another payload
    target["all"] += 1
    return base, target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    base, target = _pair(dtype)
    base_blob, target_blob = state_dict_to_bytes(base), state_dict_to_bytes(target)
    delta, stats = encode_delta(
        base,
        target,
        base_version=3,
        target_version=4,
        base_sha256=_sha(base_blob),
        target_sha256=_sha(target_blob),
    )
    assert stats.dense_tensors == 1  # "all": every element changed, sent whole
    assert 0 < stats.changed < stats.elements
    assert stats.nbytes < len(memoryview(target_blob)) / 3
    header = read_header(delta)
    assert (header.base_version, header.target_version) == (3, 4)
    held = bytearray(base_blob)
    apply_delta(bytes_to_state_dict(held), delta)
    # the patched blob is the target, byte for byte (so -0.0 and every NaN payload too)
    assert bytes(held) == bytes(target_blob)
    assert _sha(held) == header.target_sha256


def test_delta_of_identical_weights_is_empty_and_applies() -> None:
    base, _ = _pair(torch.bfloat16)
    blob = state_dict_to_bytes(base)
    delta, stats = encode_delta(
        base, base, base_version=0, target_version=1, base_sha256=_sha(blob), target_sha256=_sha(blob)
    )
    assert stats.changed == 0 and stats.dense_tensors == 0
    held = bytearray(blob)
    apply_delta(bytes_to_state_dict(held), delta)
    assert bytes(held) == bytes(blob)


def test_a_delta_that_does_not_fit_changes_nothing() -> None:
    base, target = _pair(torch.bfloat16)
    delta, _ = encode_delta(base, target, base_version=0, target_version=1, base_sha256="", target_sha256="")
    other = {k: v.float().clone() for k, v in base.items()}  # same names, another dtype
    before = bytes(state_dict_to_bytes(other))
    with pytest.raises(DeltaError, match="delta holds"):
        apply_delta(other, delta)
    assert bytes(state_dict_to_bytes(other)) == before
    missing = {k: v.clone() for k, v in base.items() if k != "sparse"}
    with pytest.raises(DeltaError, match="lack"):
        apply_delta(missing, delta)
    with pytest.raises(DeltaError, match="not a delta"):
        apply_delta(base, state_dict_to_bytes(base))
    with pytest.raises(DeltaError, match="names differ"):
        encode_delta(base, missing, base_version=0, target_version=1, base_sha256="", target_sha256="")


def test_relay_directory_points_a_region_at_one_seed_then_at_holders() -> None:
    d = RelayDirectory(stale_s=5.0)
    for mid in ("a", "b", "c"):
        d.update(mid, "eu", f"tcp://{mid}", {"main": 1}, now=0.0)
    d.update("z", "us", "tcp://z", {"main": 1}, now=0.0)
    # nobody holds version 2: "a" (the first by id) pulls from the trainer, the others wait for it
    assert d.relays_for("a", "eu", "main", 2, now=1.0) == []
    assert d.relays_for("b", "eu", "main", 2, now=1.0) == ["tcp://a"]
    assert d.relays_for("z", "us", "main", 2, now=1.0) == []  # another region: its own seed
    d.update("a", "eu", "tcp://a", {"main": 2}, now=1.0)
    assert d.relays_for("c", "eu", "main", 2, now=1.5) == ["tcp://a"]
    # a holder gone silent is not named; a member without a relay is never one
    assert d.relays_for("c", "eu", "main", 2, now=10.0) == []
    d.update("b", "eu", "", {"main": 2}, now=10.0)
    assert d.relays_for("c", "eu", "main", 2, now=10.0) == []


def test_changed_elements_are_found_in_unaligned_views_too() -> None:
    from astraflow.weights.delta import changed_indices

    a = torch.randn(4001).to(torch.bfloat16).view(torch.int16)
    b = a.clone()
    b[[0, 5, 6, 4000]] += 1
    for x, y in ((a[:4000], b[:4000]), (a[1:], b[1:]), (a[3:3999], b[3:3999])):
        assert torch.equal(changed_indices(x, y), (x != y).nonzero().reshape(-1))

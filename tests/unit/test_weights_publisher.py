"""Background publishing and the one-copy safetensors writer/reader, against a real weight server."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from astraflow.weights.client import fetch_weights
from astraflow.weights.manifest import blob_digest
from astraflow.weights.publisher import BackgroundPublisher
from astraflow.weights.server import WeightServer
from astraflow.weights.snapshot import bytes_to_state_dict, state_dict_to_bytes


def _state() -> dict[str, torch.Tensor]:
    tied = torch.randn(6, 4)
    return {
        "embed": tied,
        "head": tied,  # tied weights share memory
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "transposed": torch.randn(4, 3).t(),  # not contiguous
        "ids": torch.arange(7),
        "empty": torch.zeros(0, 3),
        "flag": torch.tensor(True),
    }


def test_writer_matches_safetensors_and_reader_parses_in_place() -> None:
    sd = _state()
    blob = state_dict_to_bytes(sd)
    # safetensors itself reads what we write, and we read what it writes
    for name, t in st_load(bytes(blob)).items():
        assert torch.equal(t, sd[name]), name
    for name, t in bytes_to_state_dict(st_save({k: v.contiguous().clone() for k, v in sd.items()})).items():
        assert torch.equal(t, sd[name]), name
    writable = bytearray(blob)
    back = bytes_to_state_dict(writable)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    # in place: the tensors are views of the pulled buffer, not copies
    view = memoryview(writable)
    view[len(view) - 1] ^= 0xFF
    assert not all(torch.equal(back[k], sd[k]) for k in sd)
    bad = bytearray(blob)
    bad[0:8] = (len(bad) * 2).to_bytes(8, "little")
    with pytest.raises(ValueError, match="header"):
        bytes_to_state_dict(bad)


def test_versions_publish_one_at_a_time_in_order_and_are_served_before_announced() -> None:
    server = WeightServer(chunk_bytes=1 << 10, keep_versions=4)
    pub = BackgroundPublisher(server, "p")
    try:
        announced: list[int] = []
        for version in (1, 2, 3):
            sd = {"w": torch.full((512,), float(version))}
            if pub.busy:
                # the trainer's next publish waits for (and announces) the previous one first
                with pytest.raises(RuntimeError, match="in flight"):
                    pub.start(version, sd, {})
                done = pub.result()
                announced.append(done.version)
            pub.start(version, sd, {"loss": 1.0})
        done = pub.result()
        announced.append(done.version)
        assert announced == [1, 2, 3] and not pub.busy
        assert done.metrics["loss"] == 1.0 and done.metrics["trainer_publish_bg_s"] >= 0
        # what is announced is already held: a puller gets exactly the hashed bytes
        got = fetch_weights(server.address, "p", 3, timeout_s=10, expect_sha256=done.manifest.sha256)
        assert blob_digest(got) == done.manifest.sha256
        assert torch.equal(bytes_to_state_dict(got)["w"], torch.full((512,), 3.0))
    finally:
        server.close()


def test_a_failed_publish_raises_in_the_trainer_thread() -> None:
    server = WeightServer()
    try:
        pub = BackgroundPublisher(server, "p")
        pub.start(1, {"w": "not a tensor"}, {})  # type: ignore[dict-item]
        # the worker's error is handed to the trainer, not lost on its thread; nothing is held
        with pytest.raises(AttributeError):
            pub.result(timeout_s=10)
        assert not pub.busy and fetch_manifest_or_none(server.address) is None
    finally:
        server.close()


def fetch_manifest_or_none(addr: str) -> object:
    """The manifest of p@1, or None when the server does not hold it."""
    from astraflow.weights.client import VersionUnavailableError, fetch_manifest

    try:
        return fetch_manifest(addr, "p", 1, timeout_s=5)
    except VersionUnavailableError:
        return None


def test_blob_bytes_is_the_size_the_blob_gets() -> None:
    # the publisher pins host memory of this size before the first version (prewarm): a size that is
    # off would pin blocks the host allocator never hands back for a blob
    from astraflow.weights.snapshot import blob_bytes, state_dict_to_bytes

    emb = torch.randn(7, 3)
    cases = [
        {"a": torch.zeros(3, dtype=torch.bfloat16), "b.weight": torch.ones(2, 5)},
        {"emb": emb, "lm_head": emb, "n": torch.tensor(3, dtype=torch.int64)},  # tied, a scalar
        {"x": torch.zeros(0), "mask": torch.ones(4, dtype=torch.bool)},  # an empty tensor
    ]
    for sd in cases:
        assert blob_bytes(sd) == len(state_dict_to_bytes(sd))
        assert blob_bytes(sd, {"step": "12"}) == len(state_dict_to_bytes(sd, {"step": "12"}))
    assert blob_bytes({"c": torch.zeros(2, dtype=torch.complex64)}) is None  # through safetensors.save


def test_prewarm_pins_nothing_for_host_weights() -> None:
    from astraflow.weights.publisher import BackgroundPublisher

    pub = BackgroundPublisher(server=None, policy="p")  # type: ignore[arg-type]  # prewarm needs no server
    assert pub.prewarm({"w": torch.ones(4)}, 3) == 0.0

"""Weight data plane over loopback: publish/fetch a real state_dict, integrity errors, eviction."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch
import zmq

from astraflow.errors import ConnectError, ProtocolError, WeightIntegrityError
from astraflow.protocol.codec import decode, encode
from astraflow.protocol.messages import Error, WeightChunk, WeightRequest
from astraflow.weights.client import VersionUnavailableError, fetch_manifest, fetch_weights
from astraflow.weights.manifest import build_manifest, chunk_span
from astraflow.weights.server import WeightServer
from astraflow.weights.snapshot import bytes_to_state_dict, state_dict_to_bytes

torch.set_num_threads(1)


def _model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    model[1].weight = model[0].weight  # tied, like an LM head: shares storage
    sd = dict(model.state_dict())
    sd["half"] = torch.randn(3, 5).to(torch.bfloat16)
    sd["view"] = torch.arange(20.0).view(4, 5)[:, 1:3]  # non-contiguous
    return sd


def test_snapshot_round_trip_exact() -> None:
    sd = _model_state()
    back = bytes_to_state_dict(state_dict_to_bytes(sd))
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_publish_fetch_round_trip_and_relay() -> None:
    sd = _model_state()
    blob = state_dict_to_bytes(sd)
    trainer = WeightServer(chunk_bytes=1000, keep_versions=2)
    relay = WeightServer(chunk_bytes=777, keep_versions=1)
    try:
        manifest = trainer.publish("p", 1, blob)
        assert len(manifest.chunk_sha256) == -(-len(blob) // 1000) > 3
        remote = fetch_manifest(trainer.address, "p", 1)
        assert msgspec.structs.replace(remote, rid=0) == manifest
        got = fetch_weights(trainer.address, "p", 1, timeout_s=10, expect_sha256=manifest.sha256)
        assert got == blob
        # a RaaS relays what it pulled with its own server; the bytes (and sha256) are the same
        assert relay.publish("p", 1, got).sha256 == manifest.sha256
        again = bytes_to_state_dict(fetch_weights(relay.address, "p", 1, timeout_s=10, window=1))
        assert all(torch.equal(again[k], v) for k, v in sd.items())
        with pytest.raises(WeightIntegrityError):
            fetch_weights(relay.address, "p", 1, timeout_s=10, expect_sha256="0" * 64)
    finally:
        trainer.close()
        relay.close()


def test_unknown_version_after_eviction() -> None:
    server = WeightServer(chunk_bytes=64, keep_versions=2)
    try:
        for v in (1, 2, 3):
            server.publish("p", v, bytes([v]) * 100)
        server.publish("q", 1, b"other policy")
        assert server.held("p") == [2, 3]
        assert server.held("q") == [1]
        with pytest.raises(VersionUnavailableError, match="p@1"):
            fetch_weights(server.address, "p", 1, timeout_s=5)
        with pytest.raises(VersionUnavailableError):
            fetch_weights(server.address, "p", 3, timeout_s=5, kind="delta")
        assert fetch_weights(server.address, "p", 3, timeout_s=5) == b"\x03" * 100
    finally:
        server.close()


def test_server_answers_bad_requests() -> None:
    server = WeightServer(chunk_bytes=10, keep_versions=1)
    server.publish("p", 1, b"x" * 25)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        for payload, code in [
            (b"\xc1", "bad_message"),
            (encode(Error(rid=2, code="x")), "unknown_type"),
            (encode(WeightRequest(rid=3, policy="p", version=1, chunk=3)), "bad_message"),
        ]:
            sock.send(payload)
            assert sock.poll(5000)
            reply = decode(sock.recv())
            assert isinstance(reply, Error) and reply.code == code
        sock.send(encode(WeightRequest(rid=4, policy="p", version=1, chunk=2)))
        assert sock.poll(5000)
        head, data = sock.recv_multipart()
        last = decode(head)
        assert isinstance(last, WeightChunk) and last.nbytes == 5 and data == b"xxxxx" and last.rid == 4
    finally:
        sock.close(0)
        ctx.term()
        server.close()


def _corrupting_server(
    blob: bytes, bad_index: int, how: str = "flip"
) -> tuple[str, threading.Event, threading.Thread]:
    """A stand-in weight server whose manifest is right but one chunk is wrong: a flipped byte
    ("flip"), a byte too many ("long"), or no bytes frame after its header ("one")."""
    manifest = build_manifest("p", 1, blob, 256)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, data = sock.recv_multipart()
            req = decode(data)
            assert isinstance(req, WeightRequest)
            if req.chunk == -1:
                manifest.rid = req.rid
                reply = manifest
            else:
                start, end = chunk_span(manifest, req.chunk)
                piece = bytearray(blob[start:end])
                head = WeightChunk(rid=req.rid, policy="p", version=1, index=req.chunk, nbytes=len(piece))
                if req.chunk == bad_index and how == "flip":
                    piece[0] ^= 0xFF
                elif req.chunk == bad_index and how == "long":
                    piece += b"x"
                elif req.chunk == bad_index and how == "one":
                    sock.send_multipart([ident, encode(head)])  # the header without its bytes
                    continue
                sock.send_multipart([ident, encode(head), bytes(piece)])
                continue
            sock.send_multipart([ident, encode(reply)])
        sock.close(0)
        ctx.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", stop, thread


def test_corrupted_chunk_raises_integrity_error() -> None:
    blob = state_dict_to_bytes(_model_state())
    addr, stop, thread = _corrupting_server(blob, bad_index=2)
    try:
        with pytest.raises(WeightIntegrityError, match="chunk 2"):
            fetch_weights(addr, "p", 1, timeout_s=10)
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.parametrize(
    ("how", "error", "match"),
    [("long", WeightIntegrityError, "wrong size"), ("one", ProtocolError, "wrong frames")],
)
def test_a_chunk_in_the_wrong_frames_is_refused(how: str, error: type[Exception], match: str) -> None:
    blob = state_dict_to_bytes(_model_state())
    addr, stop, thread = _corrupting_server(blob, bad_index=1, how=how)
    try:
        with pytest.raises(error, match=match):
            fetch_weights(addr, "p", 1, timeout_s=10)
    finally:
        stop.set()
        thread.join(5)


def test_fetch_times_out_with_connect_error() -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConnectError, match="did not send the manifest"):
            fetch_weights(f"tcp://127.0.0.1:{port}", "p", 1, timeout_s=0.5)
    finally:
        silent.close(0)
        ctx.term()


def test_pulls_reuse_a_returned_buffer_and_a_failed_pull_returns_it() -> None:
    from astraflow.weights.client import RecvBuffers

    server = WeightServer(keep_versions=2)
    into = RecvBuffers(keep=1)
    try:
        one, two = bytes(range(256)) * 4000, bytes(reversed(range(256))) * 4000
        m1, m2 = server.publish("p", 1, one), server.publish("p", 2, two)
        got = fetch_weights(server.address, "p", 1, timeout_s=10, expect_sha256=m1.sha256, into=into)
        assert got == one
        first = got.obj
        into.give(got)
        again = fetch_weights(server.address, "p", 2, timeout_s=10, expect_sha256=m2.sha256, into=into)
        assert again.obj is first and again == two  # the same pages, now holding version 2 whole
        into.give(again)
        with pytest.raises(WeightIntegrityError):
            fetch_weights(server.address, "p", 2, timeout_s=10, expect_sha256="0" * 64, into=into)
        assert into.take(len(two)).obj is first  # a refused pull keeps nothing lent
    finally:
        server.close()

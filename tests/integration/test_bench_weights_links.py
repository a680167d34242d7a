"""`astraflow bench weights`' host-to-host part on CPU: the link measured in one stream and in as
many as a pull's connections (kernel TCP and raw ZeroMQ, plain and CURVE) and the pulls over one and
over the default number of connections, every byte received by a real peer process."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from astraflow.bench.weights import Peer, _zmq  # noqa: E402
from astraflow.weights.client import default_connections  # noqa: E402


def test_links_and_pulls_in_one_and_k_streams() -> None:
    torch.manual_seed(0)
    weights = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 8 MiB
    peer = Peer("cpu")
    try:
        rows = {r["path"]: r for r in _zmq(peer, weights, 1)}
    finally:
        peer.close()
    k = default_connections()
    counts = sorted({1, k})
    for n in counts:
        streams = f"{n} stream{'s' if n > 1 else ''}"
        for link in ("TCP socket", "raw ZeroMQ TCP", "raw ZeroMQ TCP with CURVE"):
            assert rows[f"limit: {link}, loopback, {streams}"]["seconds"] > 0
        for curve in ("without", "with"):
            pull = rows[
                f"host to host: ZeroMQ pull {curve} CURVE, loopback, {n} connection{'s' if n > 1 else ''}"
            ]
            # the % printed is of the fastest raw measure, so never above either stream count's
            assert 0 < pull["vs_limit"] <= min(pull["vs_link_1_stream"], pull["vs_link_k_streams"])
            assert pull["k_streams"] == k and ("vs_curve_limit" in pull) == (curve == "with")

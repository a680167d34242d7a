"""≥ 100,000 malformed frames at a live controller process and at a live weight server process.

Each service must stay up, answer (or drop) every frame, keep its RSS bounded, and still answer a
valid request afterwards. The frames come from astraflow.bench.frames.malformed_frames: random bytes,
invalid UTF-8, truncated msgpack, wrong shapes, unknown tags, 10,000-deep nesting, huge declared
lengths, many-frame messages, bit flips, fields past their caps.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from astraflow.bench.frames import malformed_frames
from astraflow.bench.wire import (
    blast,
    hoard_chunks,
    request,
    rss_mb,
    start_controller,
    start_weight_server,
)
from astraflow.protocol.messages import StatusReply, StatusRequest, WeightManifest, WeightRequest

FRAMES = 100_000


@pytest.mark.slow
def test_malformed_frames_at_a_live_controller(tmp_path: Path) -> None:
    proc, addr = start_controller(tmp_path)
    try:
        assert isinstance(request(addr, StatusRequest(rid=1)), StatusReply)
        # the families once, so what the allocator and caches keep anyway is in the baseline
        blast(addr, malformed_frames(2_600, seed=1))
        before = rss_mb(proc.pid)
        b = blast(addr, malformed_frames(FRAMES, seed=2))
        assert proc.poll() is None, (tmp_path / "controller.log").read_text()[-3000:]
        after = rss_mb(proc.pid)
        assert b.sent == FRAMES
        # every frame is answered with an Error (a Welcome for the rare bit flip that makes a valid Hello);
        # replies past the ROUTER's per-peer send HWM are dropped when the blaster lags, by design
        assert b.errors >= 0.5 * FRAMES, b
        assert after - before < 64, f"controller RSS grew {before:.0f} -> {after:.0f} MiB"
        print(f"controller: {b}, RSS {before:.0f} -> {after:.0f} MiB")
        reply = request(addr, StatusRequest(rid=2), timeout_s=30.0)
        assert isinstance(reply, StatusReply) and reply.rid == 2
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_malformed_frames_and_chunk_hoarding_at_a_live_weight_server(tmp_path: Path) -> None:
    proc, addr = start_weight_server(tmp_path)
    probe = WeightRequest(rid=1, policy="main", version=1)
    try:
        assert isinstance(request(addr, probe, timeout_s=30.0), WeightManifest)
        blast(addr, malformed_frames(2_600, seed=1))
        before = rss_mb(proc.pid)
        b = blast(addr, malformed_frames(FRAMES, seed=3))
        assert proc.poll() is None, (tmp_path / "weights.log").read_text()[-3000:]
        assert b.sent == FRAMES and b.errors > 0
        after = rss_mb(proc.pid)
        assert after - before < 64, f"weight server RSS grew {before:.0f} -> {after:.0f} MiB"
        print(f"weight server: {b}, RSS {before:.0f} -> {after:.0f} MiB")
        assert isinstance(request(addr, probe, timeout_s=30.0), WeightManifest)

        # 1,000 requests for 1 MiB chunks from a peer that never reads: only SNDHWM chunks may queue
        before = rss_mb(proc.pid)
        hold = threading.Thread(target=hoard_chunks, args=(addr, 1000, 4.0))
        hold.start()
        time.sleep(3.0)
        held = rss_mb(proc.pid)
        hold.join()
        print(f"hoarding peer: RSS {before:.0f} -> {held:.0f} MiB while held")
        assert held - before < 48, (
            f"weight server RSS {before:.0f} -> {held:.0f} MiB for a peer that never reads"
        )
        assert proc.poll() is None
        assert isinstance(request(addr, probe, timeout_s=30.0), WeightManifest)
    finally:
        proc.kill()
        proc.wait()

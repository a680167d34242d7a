"""`astraflow bench wire`: malformed frames at a live controller and weight server, and dispatch speed.

The frame generator and the blaster here are also what tests/security's fuzz test uses, so the
bench prints the same figures the test asserts on (no crash, RSS bounded, still answering).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from astraflow.bench.frames import malformed_frames
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode

RECIPE: dict[str, Any] = {
    "run": {"name": "wire-bench", "seed": 1, "steps": 2},
    "policy": [{"name": "main", "model": "unused", "group_size": 2, "batch_prompts": 1, "max_staleness": 1}],
    "workflow": {"name": "quickstart", "options": {"size": 5}},
}
"""A controller recipe that needs no model: the bench only talks to its control plane."""


_ERROR_TAG = b"\xa4type\xa5Error"


@dataclass
class Blast:
    """What blasting a service with frames did."""

    sent: int = 0
    replies: int = 0
    errors: int = 0
    """Replies that were an Error message."""
    seconds: float = 0.0


def blast(addr: str, frames: Iterator[list[bytes]], *, sockets: int = 4, drain_s: float = 3.0) -> Blast:
    """Send every message without waiting for replies (several DEALERs, round robin), counting replies."""
    ctx: zmq.Context[Any] = zmq.Context()
    socks = []
    for _ in range(sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 5000)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(addr)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    out = Blast()
    t0 = time.monotonic()

    def drain(timeout_ms: int) -> int:
        got = 0
        for s, _ in poller.poll(timeout_ms):
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got += 1
                out.replies += 1
                # msgspec writes the tag first: an Error reply starts {"type": "Error", ...}
                if _ERROR_TAG in frames[-1][:16]:
                    out.errors += 1
        return got

    try:
        for msg in frames:
            s = socks[out.sent % sockets]
            while True:
                try:
                    s.send_multipart(msg, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    drain(10)
            out.sent += 1
            if out.sent % 512 == 0:
                drain(0)
        deadline = time.monotonic() + drain_s
        while out.replies < out.sent and time.monotonic() < deadline:
            if drain(200):
                deadline = time.monotonic() + drain_s
        out.seconds = time.monotonic() - t0
        return out
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pin(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that pins a child to `cpus` before it execs (so every thread it starts later,
    libzmq's I/O thread included, stays there); None when not pinning."""
    if cpus is None:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def start_controller(
    work: Path,
    *,
    keys: Path | None = None,
    timeout_s: float = 120.0,
    recipe_doc: dict[str, Any] | None = None,
    cpus: set[int] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """A real `astraflow controller` process on a free loopback port (with a key store if given), running
    `recipe_doc` (default: this bench's model-free RECIPE) in work/run; pinned to `cpus` if given, with
    `env` added to its environment.
    The controller binds port 0 and the address is read from its controller.addr: no port is picked
    here that another process could take before the controller binds it."""
    work.mkdir(parents=True, exist_ok=True)
    recipe = work / "recipe.json"
    recipe.write_text(json.dumps(RECIPE if recipe_doc is None else recipe_doc))
    run_dir = work / "run"
    (run_dir / "controller.addr").unlink(missing_ok=True)  # an earlier run's, in a reused --out
    args = [
        sys.executable,
        "-m",
        "astraflow",
        "controller",
        str(recipe),
        "--run-dir",
        str(run_dir),
        "--bind",
        "tcp://127.0.0.1:0",
    ]
    if keys is not None:
        args += ["--keys", str(keys)]
    log = (work / "controller.log").open("ab")
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        preexec_fn=pin(cpus),
    )
    _wait_file(run_dir / "controller.addr", proc, work / "controller.log", timeout_s)
    return proc, (run_dir / "controller.addr").read_text().strip()


_WEIGHTS_MAIN = (
    "import sys, time; from pathlib import Path; from astraflow.weights.server import WeightServer;"
    "s = WeightServer(chunk_bytes=1 << 20); s.publish('main', 1, bytes(range(256)) * (32 << 10));"
    "Path(sys.argv[1]).write_text(s.address);"
    "[time.sleep(1) for _ in iter(int, 1)]"
)


def start_weight_server(work: Path, timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """A process serving one 8 MiB version (1 MiB chunks) from a real WeightServer; returns its address."""
    work.mkdir(parents=True, exist_ok=True)
    addr_file = work / "weights.addr"
    log = (work / "weights.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WEIGHTS_MAIN, str(addr_file)], stdout=log, stderr=subprocess.STDOUT
    )
    _wait_file(addr_file, proc, work / "weights.log", timeout_s)
    return proc, addr_file.read_text().strip()


def _wait_file(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"process did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def request(addr: str, msg: m.Msg, timeout_s: float = 10.0) -> m.Msg | None:
    """One request on a fresh plain DEALER; the reply, or None if none came in time."""
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(addr)
        s.send(encode(msg))
        if not s.poll(int(timeout_s * 1000)):
            return None
        return decode(s.recv())
    finally:
        s.close(0)
        ctx.term()


def hoard_chunks(addr: str, requests: int = 1000, hold_s: float = 2.0) -> None:
    """Ask a weight server for `requests` chunks on one connection that reads nothing, then hang up."""
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(addr)
    for i in range(requests):
        s.send(encode(m.WeightRequest(rid=i + 1, policy="main", version=1, chunk=i % 8)))
    time.sleep(hold_s)
    s.close(0)
    ctx.term()


# ----- dispatch throughput -----------------------------------------------------------------------


def _roundtrips(addr: str, seconds: float, ident: bytes, curve: tuple[Any, bytes] | None) -> float:
    """Lockstep Heartbeat round trips per second from one DEALER."""
    from astraflow.transport.security import curve_client

    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, ident)
    if curve is not None:
        curve_client(s, curve[0], curve[1])
    s.connect(addr)
    beat = m.Heartbeat(rid=1, loaded={"main": 3}, busy=1, free=1)
    try:
        s.send(encode(beat))  # warm up: the connection (and CURVE handshake) is made first
        if not s.poll(10_000):
            raise RuntimeError(f"no answer from {addr}")
        s.recv()
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            s.send(encode(beat))
            decode(s.recv())
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        s.close(0)
        ctx.term()


def dispatch_throughput(seconds: float = 2.0, rounds: int = 5) -> dict[str, float]:
    """Round trips/s: a bare zmq ROUTER echo, RouterServer without keys, RouterServer with CURVE.

    The three servers run side by side and are measured in alternating rounds of seconds/rounds each;
    each figure is the best round, so a burst of load from other processes skews them alike.
    """
    from astraflow.transport.keys import KeyStore, load_keypair, new_key_files
    from astraflow.transport.server import RouterServer

    stop = threading.Event()

    def plain_echo(sock: zmq.Socket[Any]) -> None:
        while not stop.is_set():
            if sock.poll(50):
                sock.send_multipart(sock.recv_multipart())

    def dispatch(server: RouterServer) -> None:
        while not stop.is_set():
            for ident, _principal, msg in server.poll(50):
                server.send(ident, m.HeartbeatAck(rid=getattr(msg, "rid", 0)))

    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    threads = [threading.Thread(target=plain_echo, args=(router,), daemon=True)]
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = KeyStore.init(Path(tmp) / "keys")
        _, secret = new_key_files(Path(tmp) / "m", "bench")
        pair = load_keypair(secret)
        store.add("bench", pair.public, "raas")
        plain_srv = RouterServer("tcp://127.0.0.1:0", keys=None)
        curve_srv = RouterServer("tcp://127.0.0.1:0", keys=store)
        threads += [threading.Thread(target=dispatch, args=(s,), daemon=True) for s in (plain_srv, curve_srv)]
        for t in threads:
            t.start()
        targets: list[tuple[str, str, tuple[Any, bytes] | None]] = [
            ("plain_zmq", f"tcp://127.0.0.1:{port}", None),
            ("astraflow", plain_srv.address, None),
            ("astraflow_curve", curve_srv.address, (pair, store.controller_keypair().public)),
        ]
        try:
            for _ in range(rounds):
                for name, addr, curve in targets:
                    rate = _roundtrips(addr, seconds / rounds, b"bench", curve)
                    best[name] = max(best.get(name, 0.0), rate)
        finally:
            stop.set()
            for t in threads:
                t.join()
            plain_srv.close()
            curve_srv.close()
            router.close(0)
            ctx.term()
    return best


def run(frames: int, seconds: float, work: Path) -> dict[str, Any]:
    """The whole bench: fuzz a controller and a weight server, hoard chunks, measure dispatch."""
    res: dict[str, Any] = {}
    ctl, ctl_addr = start_controller(work / "controller")
    ws, ws_addr = start_weight_server(work / "weights")
    try:
        for name, proc, addr, probe in (
            ("controller", ctl, ctl_addr, m.StatusRequest(rid=7)),
            (
                "weight_server",
                ws,
                ws_addr.partition("#")[0],
                m.WeightRequest(rid=7, policy="main", version=1),
            ),
        ):
            request(addr, probe)
            before = rss_mb(proc.pid)
            b = blast(addr, malformed_frames(frames, seed=1))
            alive = proc.poll() is None
            reply = request(addr, probe) if alive else None
            res[name] = {
                "frames_sent": b.sent,
                "errors_answered": b.errors,
                "replies": b.replies,
                "seconds": round(b.seconds, 2),
                "crashed": not alive,
                "answers_after": reply is not None and not isinstance(reply, m.Error),
                "rss_mb_before": round(before, 1),
                "rss_mb_after": round(rss_mb(proc.pid), 1) if alive else None,
            }
        before = rss_mb(ws.pid)
        hold = threading.Thread(target=hoard_chunks, args=(ws_addr.partition("#")[0], 1000, 3.0))
        hold.start()
        time.sleep(2.0)
        during = rss_mb(ws.pid)
        hold.join()
        time.sleep(1.0)
        res["hoard_1000_chunks"] = {
            "rss_mb_before": round(before, 1),
            "rss_mb_while_held": round(during, 1),
            "rss_mb_after_disconnect": round(rss_mb(ws.pid), 1),
        }
    finally:
        for p in (ctl, ws):
            p.kill()
            p.wait()
    tp = dispatch_throughput(seconds)
    res["roundtrips_per_s"] = {k: round(v) for k, v in tp.items()}
    res["ratio_to_plain_zmq"] = {k: round(v / tp["plain_zmq"], 3) for k, v in tp.items()}
    return res

"""`astraflow bench weights`: seconds per version and GB/s on every weight path this machine has,
beside the physical limit measured in the same run.

A version counts as arrived when the receiving process holds it in its own parameters (the copy an
engine makes between two decode steps) after checking it. The receiver is a second process
(`python -m astraflow.bench.weights --peer`), as a RaaS is; the sender is this process, as a trainer.
The ZeroMQ rows time the pull itself (manifest request to every byte in place and verified) against
raw ZeroMQ throughput of the same bytes, and print beside it the trainer's publish (the manifest's
digests) and the receiver's apply, which a worker's pull does not wait on and which run off the
training step.

Over 400 lines because every weight path is measured beside its own physical limit through the
same peer process and reported in one table; the peer itself is bench/weights_peer.py.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPEATS = 5


def load_model(model_dir: Path, device: str) -> dict[str, Any]:
    """The model's tensors (safetensors files of a model directory) on `device`."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        from astraflow.errors import AstraflowError

        raise AstraflowError(
            f"no *.safetensors in {model_dir}",
            hint="create one with `astraflow model init --arch qwen3 --preset 0.6b-shape --out DIR`",
        )
    sd: dict[str, Any] = {}
    for f in files:
        sd.update(load_file(str(f), device=device))
    return sd


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Peer:
    """The receiving process: one JSON command per line in, one JSON answer per line out."""

    def __init__(self, device: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.bench.weights", "--peer", device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ask(self, **cmd: Any) -> dict[str, Any]:
        """Send one command; its answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench peer exited with {self.proc.wait()}")
        out = dict(json.loads(line))
        if "error" in out:
            raise RuntimeError(f"bench peer: {out['error']}")
        return out

    def close(self) -> None:
        """Stop the process."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _row(name: str, seconds: list[float], nbytes: int, limit_s: float | None) -> dict[str, Any]:
    s = statistics.median(seconds)
    return {
        "path": name,
        "seconds": s,
        "gb_per_s": nbytes / s / 1e9 if s > 0 else None,
        "vs_limit": (limit_s / s) if limit_s and s > 0 else None,
    }


def run(model_dir: Path, device: str, repeats: int = REPEATS, connections: int = 0) -> dict[str, Any]:
    """Measure every path; the result is what `--json` prints. `connections`: the ZeroMQ pull's
    connections (and the link's streams) compared with one (0: the pull's default)."""
    import torch

    torch.set_num_threads(1 if device == "cpu" else 4)  # on a CPU the receiver needs a core too
    dev = torch.device(device)
    sd = load_model(model_dir, device)
    from astraflow.weights import packed

    layout = packed.plan(sd)
    nbytes = layout.nbytes
    out: dict[str, Any] = {
        "device": _device_name(dev),
        "cores": os.cpu_count(),
        "model": str(model_dir),
        "bytes": nbytes,
        "paths": [],
    }
    versions = [{k: v + (i % 2) if v.is_floating_point() else v for k, v in sd.items()} for i in range(2)]

    # the physical limit: one copy of the same bytes on the device
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    packed.pack(sd, layout, src)
    dst = torch.empty_like(src)
    limit = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        limit.append(time.perf_counter() - t0)
    limit_s = statistics.median(limit)
    out["paths"].append(
        _row(
            "limit: copy on " + ("the GPU" if dev.type == "cuda" else "the CPU (memcpy)"),
            limit,
            nbytes,
            limit_s,
        )
    )
    del dst

    peer = Peer(device)
    try:
        out["paths"].append(_shared(peer, dev, versions, repeats, nbytes, limit_s))
        if dev.type == "cuda" and torch.cuda.device_count() >= 2:  # pragma: no cover - needs 2 GPUs
            out["paths"] += _two_gpus(versions, repeats, nbytes, layout)
        out["paths"].append(_broadcast(peer, versions, repeats, nbytes, limit_s))
        zmq_rows = _zmq(peer, versions[0], repeats, connections)
        out["paths"] += zmq_rows
    finally:
        peer.close()
    out["delta"] = _delta_fraction(versions[0])
    return out


def _shared(
    peer: Peer, dev: Any, versions: list[dict[str, Any]], repeats: int, nbytes: int, limit_s: float
) -> dict[str, Any]:
    """Same device: the trainer packs into a slot, the worker maps, checks and copies it."""
    from astraflow.weights.transport import SharedTransport

    t = SharedTransport(dev, policy="bench")
    times = []
    try:
        for v in range(1, repeats + 2):
            t0 = time.time()
            offer = t.publish(v, versions[v % 2])
            assert offer is not None
            got = peer.ask(
                op="shared",
                kind=offer.kind,
                path=offer.path,
                ipc=offer.ipc.hex(),
                version=v,
                digest=offer.digest,
            )
            if v > 1:  # the first one maps the slot and allocates the receiver's parameters
                times.append(got["done"] - t0)
    finally:
        t.close()
    name = "same GPU: CUDA IPC" if dev.type == "cuda" else "same host: shared memory"
    return _row(name, times, nbytes, limit_s)


def _broadcast(
    peer: Peer, versions: list[dict[str, Any]], repeats: int, nbytes: int, limit_s: float
) -> dict[str, Any]:
    """Other hosts' path on loopback: gloo broadcast of CPU tensors (NCCL needs a GPU per rank)."""
    import torch

    from astraflow.weights.broadcast import BroadcastHub

    cpu = [{k: v.cpu() for k, v in w.items()} for w in versions]
    hub = BroadcastHub("127.0.0.1", "127.0.0.1", torch.device("cpu"), timeout_s=60.0)
    times = []
    try:
        peer.ask(op="join", address=hub.address, token=hub.token)
        while not hub.members:
            hub.publish(0, cpu[0])
            time.sleep(0.05)
        for v in range(1, repeats + 1):
            t0 = time.time()
            hub.publish(v, cpu[v % 2])
            times.append(peer.ask(op="bcast", version=v)["done"] - t0)
        peer.ask(op="leave")
    finally:
        hub.close()
    return _row("host to host: gloo broadcast (loopback, CPU tensors)", times, nbytes, None)


def _zmq(peer: Peer, weights: dict[str, Any], repeats: int, connections: int = 0) -> list[dict[str, Any]]:
    """The ZeroMQ pull over loopback, plain and CURVE, over one connection and over the default
    number, beside the link's raw throughput of the same bytes measured in one stream and in as many
    streams as the pull's connections: a kernel TCP socket and raw ZeroMQ, plain and CURVE."""
    import zmq

    from astraflow.transport.keys import KeyPair
    from astraflow.weights.client import default_connections
    from astraflow.weights.manifest import blob_digest, hash_pool
    from astraflow.weights.server import WeightServer
    from astraflow.weights.snapshot import state_dict_to_bytes

    blob = state_dict_to_bytes({k: v.cpu() for k, v in weights.items()})
    k = connections or default_connections()
    counts = sorted({1, k})
    rows = []
    link: dict[int, float] = {}
    curve: dict[int, float] = {}
    for n in counts:
        tcp_s = _tcp(peer, blob, repeats, n)
        rows.append(_row(f"limit: TCP socket, loopback, {_streams(n)}", [tcp_s], len(blob), None))
        zmq_s = _raw(peer, blob, repeats, None, n)
        rows.append(_row(f"limit: raw ZeroMQ TCP, loopback, {_streams(n)}", [zmq_s], len(blob), None))
        link[n] = min(tcp_s, zmq_s)
        curve[n] = _raw(peer, blob, repeats, KeyPair(*zmq.curve_keypair()), n)
        rows.append(
            _row(f"limit: raw ZeroMQ TCP with CURVE, loopback, {_streams(n)}", [curve[n]], len(blob), None)
        )
    best_link, best_curve = min(link.values()), min(curve.values())
    for r in rows:
        r["vs_limit"] = best_link / r["seconds"]
    hashing = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        blob_digest(blob)
        hashing.append(time.perf_counter() - t0)
    threads = hash_pool()._max_workers
    rows.append(
        _row(f"limit: blob digest, {threads} hashing threads (a puller's check)", hashing, len(blob), None)
    )
    for use_curve in (False, True):
        keypair = KeyPair(*zmq.curve_keypair()) if use_curve else None
        server = WeightServer("127.0.0.1", keypair=keypair)
        try:
            for n in counts:
                rows.append(_pull(peer, server, blob, repeats, n, best_link))
                row = rows[-1]
                row["path"] = (
                    f"host to host: ZeroMQ pull {'with' if use_curve else 'without'} CURVE, loopback, "
                    f"{n} connection{'s' if n > 1 else ''}"
                )
                row["vs_link_1_stream"] = link[1] / row["seconds"]
                row["vs_link_k_streams"] = link[k] / row["seconds"]
                row["k_streams"] = k
                if use_curve:
                    row["vs_curve_limit"] = best_curve / row["seconds"]
        finally:
            server.close()
    return rows


def _streams(n: int) -> str:
    return f"{n} stream{'s' if n > 1 else ''}"


def _pull(
    peer: Peer, server: Any, blob: Any, repeats: int, connections: int, link_s: float
) -> dict[str, Any]:
    """Median pull over `connections` connections, with the publish and apply around it."""
    pulls, publishes, applies, ends = [], [], [], []
    base = 1000 * connections  # versions of this round: a fresh one each pull, as a trainer publishes
    for v in range(base, base + repeats + 1):
        t0 = time.time()
        m = server.publish("bench", v, blob)
        published = time.time()
        got = peer.ask(op="zmq", address=server.address, version=v, sha256=m.sha256, connections=connections)
        if v > base:  # the first pull maps the receiver's buffer and allocates its parameters
            publishes.append(published - t0)
            pulls.append(got["pull_s"])
            applies.append(got["apply_s"])
            ends.append(got["done"] - t0)
    row = _row("", pulls, len(blob), link_s)
    row.update(
        publish_s=statistics.median(publishes),
        apply_s=statistics.median(applies),
        end_to_end_s=statistics.median(ends),
    )
    return row


def _raw(peer: Peer, blob: Any, repeats: int, keypair: Any, streams: int = 1) -> float:
    """Median seconds to push the blob's bytes in 4 MiB frames to the peer over `streams` sockets,
    each in its own context (its own I/O thread on both sides), copied nowhere (with `keypair`: CURVE
    servers, so the link's encryption is in the time). A first round, which connects, is not counted."""
    import zmq

    ctxs = [zmq.Context() for _ in range(streams)]
    socks = [c.socket(zmq.PUSH) for c in ctxs]
    server_key = ""
    addresses = []
    for sock in socks:
        if keypair is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)
            server_key = keypair.public.decode()
        addresses.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    raw = []
    frames = [memoryview(blob)[i : i + (4 << 20)] for i in range(0, len(blob), 4 << 20)]
    try:
        for _ in range(repeats + 1):
            t0 = time.time()
            assert peer.proc.stdin is not None and peer.proc.stdout is not None
            cmd = {"op": "raw", "addresses": addresses, "nbytes": len(blob), "server_key": server_key}
            peer.proc.stdin.write(json.dumps(cmd) + "\n")
            peer.proc.stdin.flush()
            for i, frame in enumerate(frames):
                socks[i % streams].send(frame, copy=False)
            raw.append(json.loads(peer.proc.stdout.readline())["done"] - t0)
    finally:
        for sock, ctx in zip(socks, ctxs, strict=True):
            sock.close(0)
            ctx.term()
    return statistics.median(raw[1:])


def _tcp(peer: Peer, blob: Any, repeats: int, streams: int) -> float:
    """Median seconds to send the blob over `streams` kernel TCP sockets on loopback (a thread a
    stream on both sides), received into a reused buffer: the link without ZeroMQ. Connecting is
    not timed."""
    import socket
    import threading

    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(streams)]
    ports = [s.getsockname()[1] for s in listeners]
    cmd = {"op": "tcp", "ports": ports, "nbytes": len(blob), "rounds": repeats + 1}
    assert peer.proc.stdin is not None and peer.proc.stdout is not None
    peer.proc.stdin.write(json.dumps(cmd) + "\n")
    peer.proc.stdin.flush()
    conns = [s.accept()[0] for s in listeners]
    view = memoryview(blob)
    share = -(-len(blob) // streams)
    parts = [view[i * share : (i + 1) * share] for i in range(streams)]
    times = []
    try:
        for _ in range(repeats + 1):  # the first round (the peer's buffers' first touch) is not counted
            t0 = time.time()
            senders = [
                threading.Thread(target=c.sendall, args=(p,)) for c, p in zip(conns, parts, strict=True)
            ]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            times.append(json.loads(peer.proc.stdout.readline())["done"] - t0)
    finally:
        for c in conns + listeners:
            c.close()
    return statistics.median(times[1:])


def _two_gpus(
    versions: list[dict[str, Any]], repeats: int, nbytes: int, layout: Any
) -> list[dict[str, Any]]:  # pragma: no cover
    """GPU to GPU on one host: CUDA IPC from cuda:0 mapped and copied on cuda:1, beside a peer copy."""
    import torch

    from astraflow.weights import packed

    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    src = torch.empty(nbytes, dtype=torch.uint8, device=d0)
    packed.pack(versions[0], layout, src)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    limit = []
    for _ in range(repeats):
        torch.cuda.synchronize(d0)
        torch.cuda.synchronize(d1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(d1)
        limit.append(time.perf_counter() - t0)
    limit_s = statistics.median(limit)
    del dst, src
    peer = Peer("cuda:1")
    try:
        on0 = [{k: v.to(d0) for k, v in w.items()} for w in versions]
        row = _shared(peer, d0, on0, repeats, nbytes, limit_s)
        row["path"] = "GPU to GPU, one host: CUDA IPC"
    finally:
        peer.close()
    return [_row("limit: GPU-to-GPU peer copy", limit, nbytes, limit_s), row]


def _delta_fraction(prev: dict[str, Any]) -> dict[str, Any]:
    """The lossless delta (weights/delta.py) of a version against a copy with every 100th element
    changed, as a fraction of the full version, and its encode time on the path a trainer with these
    weights takes: on the device for GPU weights (weights/delta_device.py; the host encoder of the same
    pair timed beside it as the baseline, and both deltas checked to be the same bytes), on the host
    otherwise. Sizes on consecutive versions of a real run: `astraflow bench delta`."""
    import time as _time

    from astraflow.weights.delta import assemble, encode_delta
    from astraflow.weights.delta_device import device_parts

    target = {}
    for k, v in prev.items():
        t = v.detach().clone()
        if t.is_floating_point() and t.numel():
            t.view(-1)[::100] += 1
        target[k] = t
    full = sum(v.numel() * v.element_size() for v in prev.values())
    head: dict[str, Any] = {"base_version": 0, "target_version": 1, "base_sha256": "", "target_sha256": ""}
    on_device = any(getattr(v, "is_cuda", False) for v in prev.values())
    out: dict[str, Any] = {"path": "device" if on_device else "host"}
    if on_device:
        dev = next(v.device for v in prev.values() if v.is_cuda)
        for _ in range(2):  # the first call pays for the kernels' first launch
            _sync(dev)
            t0 = _time.perf_counter()
            on_dev, _stats = assemble(device_parts(prev, target), **head)
        out["encode_s"] = round(_time.perf_counter() - t0, 4)
    base = {k: v.detach().cpu() for k, v in prev.items()}
    tgt = {k: v.detach().cpu() for k, v in target.items()}
    t0 = _time.perf_counter()
    blob, _stats = encode_delta(base, tgt, **head)
    host_s = round(_time.perf_counter() - t0, 4)
    if on_device:
        out["host_encode_s"] = host_s
        out["same_bytes"] = bytes(memoryview(on_dev)) == bytes(memoryview(blob))
    else:
        out["encode_s"] = host_s
    out["fraction"] = round(len(memoryview(blob)) / full, 4)
    out["note"] = "every 100th element changed; real runs: astraflow bench delta"
    return out


def _device_name(dev: Any) -> str:
    import platform

    import torch

    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} x{torch.cuda.device_count()}"
    return f"CPU {platform.processor() or platform.machine()}"


def format_lines(res: dict[str, Any]) -> list[str]:
    """The human-readable report."""
    lines = [
        f"weights bench on {res['device']}, {res.get('cores')} cores: {res['bytes'] / 1e6:.1f} MB a version"
        f" ({res['model']}); the pulls' % is of the link's fastest raw measure, 1 or K streams"
    ]
    for r in res["paths"]:
        gbs = f"{r['gb_per_s']:8.2f} GB/s" if r["gb_per_s"] is not None else " " * 13
        vs = f"  {100 * r['vs_limit']:5.1f}% of its limit" if r["vs_limit"] is not None else ""
        if "vs_link_1_stream" in r:
            vs += (
                f" ({100 * r['vs_link_1_stream']:.1f}% of 1 stream, "
                f"{100 * r['vs_link_k_streams']:.1f}% of {r['k_streams']} streams)"
            )
        if "vs_curve_limit" in r:
            vs += f", {100 * r['vs_curve_limit']:5.1f}% of raw CURVE"
        lines.append(f"  {r['path']:66} {1000 * r['seconds']:10.2f} ms  {gbs}{vs}")
        if "end_to_end_s" in r:
            lines.append(
                f"  {'':66} publish {1000 * r['publish_s']:.1f} ms + pull + apply {1000 * r['apply_s']:.1f} ms"
                f" = {1000 * r['end_to_end_s']:.1f} ms end to end"
            )
    d = res["delta"]
    enc = f"encoded in {1000 * d['encode_s']:.1f} ms on the {d['path']}"
    if "host_encode_s" in d:
        enc += f" (host encoder: {1000 * d['host_encode_s']:.1f} ms, same bytes: {d['same_bytes']})"
    lines.append(f"  delta vs full: {d['fraction']}, {enc} ({d['note']})")
    return lines


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # a stuck peer shows where on `kill -USR1`
    if sys.argv[1:2] == ["--peer"]:
        from astraflow.bench.weights_peer import serve

        serve(sys.argv[2])

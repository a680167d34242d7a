"""`astraflow bench broadcast`: one trainer's weight broadcast (weights/broadcast.py) to many engines,
beside an all-reduce's bus bandwidth over the same devices, measured in the same run.

The hub (the trainer's side) runs in this process on the first device; each engine is a process of its
own on the next device (CUDA: one GPU each, NCCL; CPU: gloo), a `BroadcastMember` as a RaaS holds it.
A version counts as arrived when every engine holds all its bytes on its device; the engines check
the digest after reporting the time (a mismatch fails the bench). The weights are tensors of a model
preset's real shapes filled with random values (nothing is read from disk: the 4B and 8B shapes
would take longer to write than to send).

With `--churn`, during one broadcast an engine is killed (SIGKILL) and a new one joins: the bench
reports how long the survivors and the newcomer took to hold the next version, and fails if any of
them never does.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
from typing import Any

RECEIVE_TIMEOUT_S = 120.0
"""How long an engine may take to receive one version before the bench gives up."""
_T0 = time.monotonic()


def _progress(msg: str) -> None:
    """One line on stderr with the seconds since the bench started (long set-ups stay visible)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def preset_weights(preset: str, device: Any, seed: int = 0) -> dict[str, Any]:
    """Random tensors with the shapes and dtype of a qwen3 preset's weights, made on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.models.init import SPECIAL_TOKENS, WORDS, _qwen3_config, get_preset

    p = get_preset("qwen3", preset)
    vocab = p.vocab if p.vocab is not None else len(SPECIAL_TOKENS) + len(WORDS)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_qwen3_config(p, vocab))
    dtype = getattr(torch, p.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        x = torch.empty(t.shape, dtype=dtype, device=device)
        x.normal_(0.0, 0.02, generator=gen)
        out[name] = x
    return out


def _device(kind: str, index: int) -> Any:
    import torch

    if kind == "cuda":
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _engine(
    address: str, token: str, name: str, kind: str, index: int, timeout_s: float, out: Any, stop: Any
) -> None:
    """One engine process: receive versions, report (name, version, arrival time, digest ok)."""
    import torch

    from astraflow.weights import packed
    from astraflow.weights.broadcast import BroadcastMember

    torch.set_num_threads(1)
    from astraflow import log

    log.setup(name)  # the member's joins, failures and generations on stderr (a churn run's story)
    dev = _device(kind, index)
    member = BroadcastMember(address, token, name, dev, timeout_s=timeout_s)
    out.put((name, -1, time.time(), True))  # started
    want = 0
    while not stop.is_set():
        got = member.wait_for(want, 0.5)
        if got is None:
            continue
        at = time.time()  # the member's thread synchronised its own stream before handing it over
        ok = packed.digest(got.buf) == got.digest
        if not ok:
            log.get("bench.broadcast").warning("version %d failed its digest", got.version)
        out.put((name, got.version, at, ok))
        want = got.version + 1
    member.close()
    out.close()
    out.join_thread()  # the reports are flushed; the receiving thread may sit in a collective: leave now
    os._exit(0)


def _allreduce_rank(rank: int, world: int, port: int, kind: str, nbytes: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = _device(kind, rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=store, rank=rank, world_size=world)
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16 if kind == "cuda" else torch.float16, device=dev)
    for _ in range(2):
        dist.all_reduce(x)
    if kind == "cuda":
        torch.cuda.synchronize(dev)
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    if kind == "cuda":
        torch.cuda.synchronize(dev)
    dt = (time.perf_counter() - t0) / reps
    if rank == 0:
        out.put(2 * (world - 1) / world * x.numel() * x.element_size() / dt / 1e9)
    dist.destroy_process_group()


def allreduce_bus_gbs(world: int, kind: str, nbytes: int) -> float:
    """An all-reduce's bus bandwidth (GB/s) over `world` devices (processes), the physical reference."""
    from torch.distributed import TCPStore

    ctx = mp.get_context("spawn")
    probe = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe  # frees the port for rank 0's own store
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, world, port, kind, nbytes, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=300))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


class _Engines:
    """The engine processes and their reports, one queue each: a queue's writers share a lock and a
    pipe, so an engine killed while it reports would block (or tear the message of) every other writer
    of a shared one, and the bench would wait for reports that never come."""

    def __init__(self, address: str, token: str, kind: str, timeout_s: float) -> None:
        self.ctx = mp.get_context("spawn")
        self.address, self.token, self.kind, self.timeout_s = address, token, kind, timeout_s
        self.outs: dict[str, Any] = {}
        self.stop = self.ctx.Event()
        self.procs: dict[str, Any] = {}
        self.devices: dict[str, int] = {}
        self.seen: dict[str, dict[int, float]] = {}
        self.bad: list[str] = []

    def start(self, name: str, index: int) -> None:
        out = self.ctx.Queue()
        p = self.ctx.Process(
            target=_engine,
            args=(self.address, self.token, name, self.kind, index, self.timeout_s, out, self.stop),
            daemon=True,
        )
        p.start()
        self.procs[name], self.outs[name], self.devices[name] = p, out, index
        self.seen[name] = {}

    def kill(self, name: str) -> int:
        """SIGKILL engine `name`; returns the device index it held."""
        p = self.procs.pop(name)
        self.outs.pop(name)  # never read again: the kill may leave half a report in it
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        self.seen.pop(name, None)
        return self.devices.pop(name)

    def _drain(self) -> bool:
        """Take every report waiting in the live engines' queues; whether there was any."""
        got = False
        for out in list(self.outs.values()):
            while True:
                try:
                    name, v, at, ok = out.get_nowait()
                except queue.Empty:
                    break
                got = True
                if name in self.seen:
                    self.seen[name].setdefault(v, at)
                    if not ok:
                        self.bad.append(f"{name} v{v}")
        return got

    def wait(self, version: int, timeout_s: float) -> dict[str, float]:
        """Arrival time of `version` (or a newer one) at every live engine."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = {
                n: min(t for v, t in s.items() if v >= version)
                for n, s in self.seen.items()
                if any(v >= version for v in s)
            }
            if len(done) == len(self.procs):
                return done
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self.procs) - set(done))
                raise TimeoutError(f"engines {missing} did not receive version {version} in {timeout_s:.0f}s")
            if not self._drain():
                time.sleep(min(left, 0.005))

    def close(self) -> None:
        self.stop.set()
        for p in self.procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()


def _wait_joined(hub: Any, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while int(hub.store.add(f"{hub.token}/njoin", 0)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} engines did not register with the broadcast store in {timeout_s:.0f}s")
        time.sleep(0.05)


def run_preset(
    preset: str, engines: int, kind: str, repeats: int, churn: bool, timeout_s: float
) -> dict[str, Any]:
    """Seconds per version from the hub to every engine, for one preset."""
    import torch

    from astraflow.weights.broadcast import BroadcastHub

    dev = _device(kind, 0)
    weights = preset_weights(preset, dev)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    hub = BroadcastHub("127.0.0.1", "127.0.0.1", dev, timeout_s=timeout_s)
    pool = _Engines(hub.address, hub.token, kind, timeout_s)
    row: dict[str, Any] = {"preset": preset, "engines": engines, "bytes": nbytes}
    try:
        for i in range(engines):
            pool.start(f"engine-{i}", i + 1)
        _progress(f"{preset}: {nbytes / 1e9:.2f} GB of weights made; starting {engines} engines")
        _wait_joined(hub, engines, RECEIVE_TIMEOUT_S)
        _progress(f"{preset}: {engines} engines registered; sending version 0 (forms the group)")
        hub.publish(0, weights)  # the first version forms the generation (and warms NCCL up)
        pool.wait(0, RECEIVE_TIMEOUT_S)
        _progress(f"{preset}: version 0 at every engine")
        times, packs = [], []
        for v in range(1, repeats + 1):
            t0 = time.time()
            hub.publish(v, weights)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()  # the packing (not the broadcast's stream)
            packs.append(time.time() - t0)
            arrived = pool.wait(v, RECEIVE_TIMEOUT_S)
            times.append(max(arrived.values()) - t0)
            _progress(f"{preset}: version {v} at every engine in {times[-1] * 1e3:.1f} ms")
        med = statistics.median(times)
        row.update(
            seconds=med,
            pack_s=statistics.median(packs),
            gbs=nbytes / med / 1e9,
            seconds_all=times,
        )
        if churn:
            row["churn"] = _churn(hub, pool, weights, repeats + 1, engines, dev)
        row["digest_mismatches"] = pool.bad
    finally:
        pool.close()
        hub.close()
    return row


def _churn(
    hub: Any, pool: _Engines, weights: dict[str, Any], v: int, engines: int, dev: Any
) -> dict[str, Any]:
    """Kill an engine during a broadcast and add a new one: time until every live engine holds a newer version."""
    import torch

    from astraflow import log

    log.setup("hub")  # the hub's dropped and new generations on stderr, beside the engines'
    victim = sorted(pool.procs)[0]
    _progress(f"churn: killing {victim} during version {v}, starting engine-new")
    t0 = time.time()
    hub.publish(v, weights)
    freed = pool.kill(victim)  # mid-broadcast (the publish returned; the sender thread is sending)
    # the newcomer takes the dead engine's device: NCCL refuses two ranks of one group on one GPU
    pool.start("engine-new", freed)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    # the killed member's generation fails at its collective timeout; survivors and the newcomer
    # register again and get the newest version: publish the next one once the newcomer registered
    _wait_joined(hub, engines + 1, RECEIVE_TIMEOUT_S)
    hub.publish(v + 1, weights)
    arrived = pool.wait(v + 1, 3 * RECEIVE_TIMEOUT_S)
    return {
        "killed": victim,
        "added": "engine-new",
        "recovered_s": max(arrived.values()) - t0,  # includes the collective timeout of the failed generation
        "engines_after": sorted(arrived),
    }


def run(
    presets: list[str], engines: int, kind: str, repeats: int, churn: bool, timeout_s: float = 15.0
) -> dict[str, Any]:
    """Every preset, then the all-reduce reference over the same number of devices."""
    import torch

    if kind == "cuda":
        have = torch.cuda.device_count()
        if have < engines + 1:
            from astraflow.errors import AstraflowError

            raise AstraflowError(
                f"--engines {engines} needs {engines + 1} GPUs (one for the trainer), {have} visible",
                hint="lower --engines (NCCL allows one rank per GPU), or use --device cpu",
            )
    rows = [run_preset(p, engines, kind, repeats, churn, timeout_s) for p in presets]
    _progress(f"all-reduce over {engines + 1} devices")
    ref = allreduce_bus_gbs(engines + 1, kind, max(r["bytes"] for r in rows) if kind == "cpu" else 1 << 30)
    device = torch.cuda.get_device_name(0) if kind == "cuda" else "cpu"
    return {
        "device": device,
        "kind": kind,
        "engines": engines,
        "rows": rows,
        "allreduce_bus_gbs": ref,
        "timeout_s": timeout_s,
    }


def format_lines(res: dict[str, Any]) -> list[str]:
    """The table `bench broadcast` prints."""
    ref = res["allreduce_bus_gbs"]
    lines = [
        f"broadcast to {res['engines']} engines on {res['device']} ({res['kind']}); "
        f"all-reduce bus bandwidth over {res['engines'] + 1} devices: {ref:.1f} GB/s"
    ]
    for r in res["rows"]:
        lines.append(
            f"  {r['preset']:>11}: {r['bytes'] / 1e9:6.2f} GB in {r['seconds'] * 1e3:8.1f} ms to every engine "
            f"({r['gbs']:6.1f} GB/s, {r['gbs'] / ref:5.2f}x the all-reduce bus bandwidth; pack {r['pack_s'] * 1e3:.1f} ms)"
        )
        if "churn" in r:
            c = r["churn"]
            lines.append(
                f"               churn: {c['killed']} killed mid-broadcast, {c['added']} joined: every live engine "
                f"({len(c['engines_after'])}) held the next version {c['recovered_s']:.1f} s after "
                f"(the failed generation's timeout: {res['timeout_s']:g} s)"
            )
        if r["digest_mismatches"]:
            lines.append(f"               DIGEST MISMATCH: {r['digest_mismatches']}")
    return lines

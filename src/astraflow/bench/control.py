"""`astraflow bench control`: how many sequences a second one live controller moves, and what each
member costs it.

A real `astraflow controller` process runs the quickstart's shape (32 prompts x 16 samples a step,
or another: `Shape`) with no model anywhere; simulated members in a few processes
(bench/control_sim.py) speak the protocol as real members do, each with its own socket, routing id,
heartbeats and (with `--curve`) its own CURVE key: two RaaS members lease tasks and answer each at
once with trivial episodes, one trainer takes each batch and announces the next version at once, and
every further member is a RaaS that only heartbeats. So the figures are the controller's own cost:
sequences/s and steps/s through it, its CPU seconds per step, p50/p99 of task and batch requests,
its RSS per member. The same run measures the physical limits on this machine: msgpack messages/s
through a raw ZeroMQ ROUTER, and SQLite rows/s in WAL mode.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from astraflow.bench import threads
from astraflow.bench.control_recipe import POLICY, Shape, recipe  # recipe, POLICY: re-exported
from astraflow.bench.control_rounds import compare, medians
from astraflow.bench.control_sim import SLOT_S, SimSpec
from astraflow.bench.cpus import cpu_shares, cpu_ticks, idle_siblings, simulator_cpus
from astraflow.bench.wire import pin, rss_mb, start_controller
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.state.archiver import CPUS_ENV

ACTIVE = 2
"""RaaS members that lease and answer tasks; every other simulated worker only heartbeats."""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct_ms(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs (seconds) in milliseconds; None without samples."""
    s = sorted(xs)
    return round(1000 * s[min(len(s) - 1, int(q * len(s)))], 2) if s else None


def _keys(work: Path, names: list[str]) -> Path:
    """A controller key store with one raas/trainer key per simulated member, written in one go."""
    from astraflow.transport.keys import KeyStore, write_member_keys

    store = KeyStore.init(work / "keys")
    write_member_keys(
        store,
        work / "member-keys",
        [
            (n, "trainer" if n == "trainer-main" else "raas", POLICY if n == "trainer-main" else None)
            for n in names
        ]
        + [("bench-observer", "observer", None)],
    )
    (work / "member-keys" / "controller.key_secret").write_bytes(
        (work / "keys" / "controller.key_secret").read_bytes()
    )
    return work / "member-keys"


def run_one(
    members: int,
    *,
    curve: bool,
    seconds: float,
    warmup_steps: int,
    heartbeat_s: float,
    procs: int,
    work: Path,
    results_mode: str = "grouped",
    keep_steps: int = 0,
    tokens: int = 3,
    idle_beats_per_s: float | None = None,
    controller_cpu: int | None = None,
    settle_s: float = 0.0,
    shape: Shape = Shape(),
    archiver: str = "inline",
) -> dict[str, Any]:
    """One controller of the recipe's `shape` with `members` simulated members (2 active RaaS + idle
    ones + 1 trainer), each sequence `tokens` generated tokens long; with `controller_cpu`, the controller alone on that CPU
    and the simulators on the others."""
    work.mkdir(parents=True, exist_ok=True)
    workers = max(members, ACTIVE)
    names = ["trainer-main"] + [f"sim-{i:05d}" for i in range(workers)]
    roles = {n: ("trainer" if i == 0 else "raas" if i <= ACTIVE else "idle") for i, n in enumerate(names)}
    keys_dir = _keys(work, names) if curve else None
    run_dir = work / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ctl, addr = start_controller(
        work,
        keys=work / "keys" if curve else None,
        recipe_doc=recipe(heartbeat_s, workers, keep_steps, idle_beats_per_s, shape, archiver),
        cpus=None if controller_cpu is None else {controller_cpu},
        # the archiver process (if any) runs beside the simulators, off the controller's core
        env=None
        if controller_cpu is None
        else {CPUS_ENV: ",".join(map(str, sorted(simulator_cpus(controller_cpu))))},
    )
    others = None if controller_cpu is None else simulator_cpus(controller_cpu)
    sims: list[subprocess.Popen[bytes]] = []
    outs: list[Path] = []
    stop = work / "stop"
    try:
        # the trainer and each active worker get a process of their own (a process driving all three
        # built their messages one after another, and at 4,096 sequences a step the controller waited
        # on it: 70% busy); the idle members share `procs` - 1 processes
        active = names[: ACTIVE + 1]
        idle = names[ACTIVE + 1 :]
        n_idle = max(1, procs - 1) if idle else 0
        groups = [[name] for name in active] + [idle[i::n_idle] for i in range(n_idle)]
        hard_deadline = time.time() + 60 + seconds * 4 + members * 0.02
        for i, group in enumerate(groups):
            spec = SimSpec(
                addr=addr,
                members=group,
                roles={n: roles[n] for n in group},
                policy=POLICY,
                heartbeat_s=heartbeat_s,
                slots=shape.request,
                deadline=hard_deadline,
                stop_file=str(stop),
                out=str(work / f"sim{i}.json"),
                keys_dir=str(keys_dir) if keys_dir else "",
                seed=i,
                results=results_mode,
                tokens=tokens,
            )
            (work / f"sim{i}.spec.json").write_text(json.dumps(asdict(spec)))
            outs.append(work / f"sim{i}.json")
            sims.append(
                subprocess.Popen(
                    [sys.executable, "-m", "astraflow.bench.control_sim", str(work / f"sim{i}.spec.json")],
                    stdout=(work / f"sim{i}.log").open("ab"),
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=pin(others),
                )
            )
        joined = _wait_joined(addr, keys_dir, len(names), deadline=time.monotonic() + 60 + members * 0.02)
        steps0 = _wait_step(run_dir, warmup_steps, deadline=time.monotonic() + 120)
        time.sleep(settle_s)  # the joins' aftermath (handshakes, first beats) out of the window
        at0 = cpu_ticks(controller_cpu) if controller_cpu is not None else {}
        t0, cpu0, th0 = time.time(), _cpu_s(ctl.pid), threads.sample(ctl.pid)
        time.sleep(seconds)
        t1, cpu1, th1 = time.time(), _cpu_s(ctl.pid), threads.sample(ctl.pid)
        at1 = cpu_ticks(controller_cpu) if controller_cpu is not None else {}
        rss = rss_mb(ctl.pid)
        alive_end = _wait_joined(addr, keys_dir, len(names), deadline=time.monotonic())
        stop.touch()
        for p in sims:
            p.wait(timeout=60)
    finally:
        stop.touch()
        for p in sims:
            if p.poll() is None:
                p.kill()
        ctl.kill()
        ctl.wait()
    results = [json.loads(o.read_text()) for o in outs if o.is_file()]
    state = _state_size(run_dir)
    steps = [s for r in results for s in r["steps"] if t0 <= s[0] <= t1]
    n_steps = len(steps)
    seqs = sum(s[2] for s in steps)
    window = t1 - t0
    task_lat = [x for r in results for x in r["task_latency_s"]]
    batch_lat = [x for r in results for x in r["batch_latency_s"]]
    return {
        "members": len(names),
        "workers": workers,
        "curve": curve,
        "results": results_mode,
        "tokens": tokens,
        "joined": joined,
        "refused": sum(len(r["refused"]) for r in results),
        "first_refusals": [x for r in results for x in r["refused"]][:3],
        "errors": [x for r in results for x in r["errors"]][:5],
        "warmup_steps": steps0,
        "settle_s": settle_s,
        "window_s": round(window, 2),
        "steps": n_steps,
        "steps_per_s": round(n_steps / window, 2),
        "sequences_per_s": round(seqs / window, 1),
        "controller_cpu_pct": round(100 * (cpu1 - cpu0) / window, 1),
        "controller_cpu_ms_per_step": round(1000 * (cpu1 - cpu0) / n_steps, 1) if n_steps else None,
        "controller_cpu_us_per_sequence": round(1e6 * (cpu1 - cpu0) / seqs, 1) if seqs else None,
        **threads.per_step(th0, th1, n_steps, window),
        **cpu_shares(at0, at1),
        "task_ms_p50": _pct_ms(task_lat, 0.5),
        "task_ms_p99": _pct_ms(task_lat, 0.99),
        "batch_ms_p50": _pct_ms(batch_lat, 0.5),
        "batch_ms_p99": _pct_ms(batch_lat, 0.99),
        **_beat_rates(results, t0, t1),
        "alive_after": alive_end,
        "controller_rss_mb": round(rss, 1),
        **state,
    }


def _beat_rates(results: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Heartbeats and acks a second in the measured window [t0, t1] (the simulators count them per
    SLOT_S), the same over each simulator's whole life (joins and the idle interval's ramp included),
    what the idle members' intervals at the stop add up to, and how many idle members beat at which."""
    first, last = math.ceil(t0 / SLOT_S), math.floor(t1 / SLOT_S)  # the whole slots inside the window
    span = max(1e-9, (last - first) * SLOT_S)
    beats = acks = 0
    intervals: dict[str, int] = {}
    for r in results:
        for k, (b, a) in r["beats_by_slot"].items():
            if first <= int(k) < last:
                beats, acks = beats + b, acks + a
        for gap, n in r["idle_intervals"].items():
            intervals[gap] = intervals.get(gap, 0) + n
    life = sum(r["heartbeats"] / max(1e-9, r["ended"] - r["started"]) for r in results)
    return {
        "heartbeats_per_s": round(beats / span, 1),
        "acks_per_s": round(acks / span, 1),
        "heartbeats_per_s_life": round(life, 1),
        "idle_beats_per_s_told": round(sum(n / float(g) for g, n in intervals.items()), 1),
        "idle_intervals": dict(sorted(intervals.items(), key=lambda kv: float(kv[0]))),
    }


def _state_size(run_dir: Path) -> dict[str, Any]:
    """state.db's size (with its WAL), the trajectories it holds, the last step and the archive's size."""
    from astraflow.state import trajectories
    from astraflow.state.store import Store

    db = run_dir / "state.db"
    size = sum(f.stat().st_size for f in run_dir.glob("state.db*") if f.is_file())
    archive = (
        sum(f.stat().st_size for f in (run_dir / "archive").glob("*.parquet"))
        if (run_dir / "archive").is_dir()
        else 0
    )
    store = Store.open_readonly(db)
    try:
        rows = trajectories.count(store, POLICY)  # the bench's one policy
        step = int(store.policy(POLICY)["step"])
        dead = sum(1 for e in store.events(1_000_000) if e["kind"] == "member_dead")
    finally:
        store.close()
    return {
        "members_declared_dead": dead,
        "last_step": step,
        "state_db_mb": round(size / 2**20, 2),
        "trajectories_in_db": rows,
        "archive_mb": round(archive / 2**20, 2),
    }


def _status(addr: str, keys_dir: Path | None) -> dict[str, Any] | None:
    """The controller's status document over a fresh connection (an observer-less plain socket without keys)."""
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        if keys_dir is not None:
            from astraflow.transport.keys import load_keypair
            from astraflow.transport.security import curve_client

            server = load_keypair(keys_dir / "controller.key_secret").public
            curve_client(s, load_keypair(keys_dir / "bench-observer.key_secret"), server)
            s.setsockopt(zmq.ROUTING_ID, b"bench-observer")
        s.connect(addr)
        s.send(encode(m.StatusRequest(rid=1)))
        if not s.poll(10_000):
            return None
        reply = decode(s.recv())
        return reply.status if isinstance(reply, m.StatusReply) else None
    finally:
        s.close(0)
        ctx.term()


def _wait_joined(addr: str, keys_dir: Path | None, want: int, deadline: float) -> int:
    """Alive members the controller counts, once all `want` joined (or the deadline passed; asked once at least)."""
    alive = 0
    while True:
        doc = _status(addr, keys_dir)
        if doc is not None:
            alive = sum(1 for mem in doc.get("members", []) if mem.get("status") == "alive")
        if alive >= want or time.monotonic() >= deadline:
            return alive
        time.sleep(max(0.5, want / 2000))  # a status of 10,000 members is itself work for the controller


def _wait_step(run_dir: Path, step: int, deadline: float) -> int:
    """Wait until the policy recorded `step` versions or the deadline passed; the step reached."""
    from astraflow.state.store import Store

    got = 0
    while time.monotonic() < deadline:
        try:
            store = Store.open_readonly(run_dir / "state.db")
            try:
                got = int(store.policy(POLICY)["step"])
            finally:
                store.close()
        except Exception:
            got = 0
        if got >= step:
            return got
        time.sleep(0.2)
    return got  # short of the warm-up: the row says so (warmup_steps), the window is measured anyway


def run(
    member_counts: list[int],
    *,
    curve: list[bool],
    seconds: float,
    warmup_steps: int,
    heartbeat_s: float,
    procs: int,
    work: Path,
    progress: Any = None,
    results: tuple[str, ...] = ("grouped",),
    keep_steps: int = 0,
    tokens: int = 3,
    idle_beats_per_s: float | None = None,
    controller_cpu: int | None = None,
    settle_s: float = 0.0,
    repeat: int = 1,
    shape: Shape = Shape(),
    archiver: str = "inline",
) -> dict[str, Any]:
    """Every (results mode, curve, members) combination, then the physical limits; ratios against the
    first row of the same results mode, CURVE setting and round. With `repeat` > 1 the member counts
    run that many rounds in turn (2, 10000, 2, 10000, ...: a host's drift falls on both counts alike)
    and `medians` holds each count's median rate and median ratio to its own round's first row."""
    rows = []
    opts: dict[str, Any] = {"seconds": seconds, "warmup_steps": warmup_steps, "heartbeat_s": heartbeat_s}
    opts["procs"] = procs
    opts |= {"keep_steps": keep_steps, "tokens": tokens, "idle_beats_per_s": idle_beats_per_s}
    opts |= {"controller_cpu": controller_cpu, "settle_s": settle_s, "shape": shape, "archiver": archiver}
    for mode in results:
        for c in curve:
            for rnd in range(repeat):
                for n in member_counts:
                    if progress is not None:
                        progress(
                            f"controller with {n} simulated workers, CURVE {'on' if c else 'off'}, {mode} results"
                            + (f", round {rnd + 1}/{repeat}" if repeat > 1 else "")
                            + " ..."
                        )
                    work_n = work / (
                        f"{'curve' if c else 'plain'}-{mode}-{n}" + (f"-r{rnd}" if repeat > 1 else "")
                    )
                    rows.append({**run_one(n, curve=c, work=work_n, results_mode=mode, **opts), "round": rnd})
    compare(rows)
    if progress is not None:
        progress("physical limits: raw ZeroMQ + msgpack, SQLite WAL ...")
    from astraflow.bench.control_limits import sqlite_rows_rate, zmq_msgpack_rate

    limits = {"zmq_msgpack_msgs_per_s": round(zmq_msgpack_rate()), **sqlite_rows_rate()}
    return {
        "rows": rows,
        "shape": asdict(shape),
        "medians": medians(rows) if repeat > 1 else [],
        "limits": limits,
        "cpus": os.cpu_count(),
        "controller_cpu": controller_cpu,
        "idle_siblings": None if controller_cpu is None else idle_siblings(controller_cpu),
        "load_avg": os.getloadavg()[0],
    }

"""`astraflow bench control --beats N`: what one heartbeat of an idle member costs the controller, in
process.

One `Controller` on a real state.db joins N members (a Hello each, through `Controller.dispatch`),
then every member beats once per recipe interval for a few rounds, paced by the real clock, so the
heartbeat rate limit, the liveness table's writes (one transaction a second) and the periodic work
(a tick every 0.1 s, as the loop runs it) see what they would see live. Each beat is an idle one: no
lease to renew, nothing waiting, no error, the same load every time, a fresh rid each beat (as a
member sends it). Timed (CPU of this process): `dispatch`, encoding the replies, and the ticks. The
receive path is measured in the same run: frames from up to SENDERS DEALER sockets (each its own
routing id, sent before the timed part) taken off a real `RouterServer` with `poll`, which receives
and decodes them (CPU of the receiving thread only; libzmq's I/O thread, which reads the TCP
connections beside it, is not counted).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from astraflow.bench.control import POLICY, recipe
from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode

TICK_S = 0.1
"""Seconds between the controller's rounds of periodic work (its loop's TICK_S)."""


def _hello(ident: str) -> bytes:
    return encode(
        m.Hello(
            rid=1,
            member_id=ident,
            role="raas",
            protocol=m.PROTOCOL_VERSION,
            policies=[POLICY],
            slots=32,
            pid=1,
            host=f"sim-{ident}",
            hardware="simulated",
        )
    )


def _beat(rid: int) -> bytes:
    """An idle member's heartbeat: nothing leased, nothing waiting, no error."""
    return encode(m.Heartbeat(rid=rid, loaded={POLICY: 0}, busy=0, free=32))


def dispatch_cost(
    members: int, *, rounds: int = 6, heartbeat_s: float = 0.5, profile: bool = False, top: int = 20
) -> dict[str, Any]:
    """Join `members` members and beat each once per interval for `rounds` intervals; CPU per beat
    of the first round (a member's first beat after its Hello reads its row) and of the others."""
    from astraflow.roles.controller import Controller
    from astraflow.state.store import Store

    idents = [f"sim-{i:05d}" for i in range(members)]
    with tempfile.TemporaryDirectory(prefix="astraflow-beats-") as tmp:
        rec = Recipe.model_validate(recipe(heartbeat_s, members))
        store = Store.open(Path(tmp) / "state.db")
        ctl = Controller(rec, Path(tmp), store)
        ctl.start()
        t0 = time.process_time()
        for ident in idents:
            out = ctl.dispatch(ident.encode(), decode(_hello(ident)))
            for _, reply in out:
                encode(reply)
        join_cpu = time.process_time() - t0
        # a fresh rid per beat as members send them, decoded before the timed part (the receive
        # part below times the socket and decoding)
        frames = [[decode(_beat(2 + r)) for _ in idents] for r in range(rounds)]
        keys = [ident.encode() for ident in idents]
        ticks_per_round = max(1, round(heartbeat_s / TICK_S))
        every = max(1, members // ticks_per_round)
        replies = 0
        cpu: list[float] = []
        prof = cProfile.Profile() if profile else None
        start = time.time()
        for r in range(rounds):
            # the next interval by the real clock: rate limits and the table's flushes see real time
            wait = start + r * heartbeat_s - time.time()
            if wait > 0:
                time.sleep(wait)
            if prof is not None:
                prof.enable()
            t0 = time.process_time()
            for i, (key, beat) in enumerate(zip(keys, frames[r], strict=True)):
                for _, reply in ctl.dispatch(key, beat):
                    encode(reply)
                    replies += 1
                if i % every == every - 1:
                    ctl.tick()
            cpu.append(time.process_time() - t0)
            if prof is not None:
                prof.disable()
        alive = sum(1 for row in store.members("alive"))
        store.close()
    beats = rounds * members
    out_: dict[str, Any] = {
        "members": members,
        "rounds": rounds,
        "beats": beats,
        "alive_after": alive,
        "replies": replies,
        "join_us_per_member": round(1e6 * join_cpu / max(1, members), 1),
        "us_per_beat_first_round": round(1e6 * cpu[0] / members, 2),
        "us_per_beat": round(1e6 * sum(cpu[1:]) / max(1, beats - members), 2),
        "core_share_at_interval": round(sum(cpu[1:]) / max(1, beats - members) * members / heartbeat_s, 4),
    }
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out_["profile"] = buf.getvalue()
    return out_


def _thread_cpu_s() -> float:
    return time.thread_time()


SENDERS = 3000
"""Most DEALER sockets of the receive part: both ends live in this process (each end of a connection
is a file descriptor), and the receive path's cost per frame does not grow with the connections."""


def receive_cost(members: int, *, rounds: int = 3) -> dict[str, Any]:
    """Frames from up to SENDERS DEALER sockets (each its own routing id), `rounds` times `members`
    frames in all, taken off a real RouterServer with `poll`: CPU of the receiving thread per frame
    (libzmq's I/O thread not counted)."""
    import zmq

    from astraflow.transport.server import RouterServer

    server = RouterServer("tcp://127.0.0.1:0")
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, SENDERS + 64)
    socks = []
    try:
        senders = min(members, SENDERS)
        for i in range(senders):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, f"sim-{i:05d}".encode())
            s.connect(server.address)
            socks.append(s)
        frame = _beat(7)
        got = 0
        cpu = 0.0
        for _ in range(rounds * max(1, members // senders)):
            for s in socks:
                s.send(frame, copy=True)
            time.sleep(0.3)  # the frames reach the ROUTER's queues (libzmq's I/O thread): then drain
            want = got + senders
            deadline = time.monotonic() + 60
            while got < want and time.monotonic() < deadline:
                t0 = _thread_cpu_s()
                polled = server.poll(100)
                cpu += _thread_cpu_s() - t0
                got += len(polled)
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        server.close()
    return {
        "frames": got,
        "receive_us_per_beat": round(1e6 * cpu / max(1, got), 2),
    }


def run(
    members: int, *, rounds: int = 6, heartbeat_s: float = 0.5, profile: bool = False, top: int = 20
) -> dict[str, Any]:
    """Both parts: dispatch (handle, encode the replies, ticks) and the receive path (socket, decode)."""
    res = dispatch_cost(members, rounds=rounds, heartbeat_s=heartbeat_s, profile=profile, top=top)
    res.update(receive_cost(members))
    res["total_us_per_beat"] = round(res["us_per_beat"] + res["receive_us_per_beat"], 2)
    return res


def render(r: dict[str, Any]) -> str:
    """The result as lines for a terminal (profile, when taken, after the figures)."""
    lines = [
        f"in-process controller, {r['members']} idle members, {r['rounds']} beats each "
        f"({r['beats']} beats; {r['replies']} replies; {r['alive_after']} alive at the end)",
        f"join: {r['join_us_per_member']:.1f} us of CPU per member",
        f"first beat after the join: {r['us_per_beat_first_round']:.2f} us",
        f"heartbeat: {r['receive_us_per_beat']:.2f} us receive + decode, {r['us_per_beat']:.2f} us "
        f"dispatch + reply + ticks = {r['total_us_per_beat']:.2f} us; "
        f"{100 * r['core_share_at_interval']:.1f}% of a core for dispatch at the interval",
    ]
    if "profile" in r:
        lines.append(r["profile"])
    return "\n".join(lines)

"""A rogue member for the attack tests: a process of its own holding a real, registered key, driven by
the test one JSON command per line on stdin, each answered by one JSON line on stdout.

It speaks the codec over a raw CURVE DEALER (no client library, so it does what a hostile member
would: ask for everything, answer every lease with an error, heartbeat leases it never works on,
flood, open weight-plane connections it never reads). Between commands, with `beat` on, it sends one
heartbeat a second listing the leases it holds, as a live worker does.

    python -m tests.security.rogue --controller ADDR --key NAME.key_secret --controller-key controller.key
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.transport.keys import KeyPair, load_keypair, load_public
from astraflow.transport.security import curve_client

BEAT_S = 1.0
"""Heartbeat interval with `beat` on."""
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
"""What a watched connection's monitor reports: the end of its handshake either way."""


class Rogue:
    """One CURVE connection to the controller and the leases it holds."""

    def __init__(self, addr: str, pair: KeyPair, controller_public: bytes, routing_id: str) -> None:
        self.pair = pair
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self._dealer(addr, controller_public, routing_id)
        self.rid = 0
        self.held: dict[int, int] = {}
        """Task id -> lease epoch of every lease held."""
        self.beating = False
        self.last_beat = 0.0
        self.member = False
        """Whether a Hello was welcomed."""
        self.monitors: dict[int, zmq.Socket[Any]] = {}
        """Watched socket's id() -> the reader of its handshake events."""

    def _dealer(self, addr: str, server: bytes, routing_id: str, watch: bool = False) -> zmq.Socket[Any]:
        """A CURVE DEALER connected to addr; watch: with a monitor of its handshake (see _handshake)."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, (routing_id or f"rogue.{os.urandom(6).hex()}").encode())
        curve_client(s, self.pair, server)
        if watch:  # the monitor's reader is connected before the handshake can begin
            s.monitor(f"inproc://handshake-{id(s)}", HANDSHAKE_EVENTS)
            self.monitors[id(s)] = self.ctx.socket(zmq.PAIR)
            self.monitors[id(s)].connect(f"inproc://handshake-{id(s)}")
        s.connect(addr)
        return s

    def ask(self, msg: m.Msg, timeout_s: float = 30.0) -> m.Msg | None:
        """Send one message and wait for the reply with its rid (None: no reply in time)."""
        self.rid += 1
        msg.rid = self.rid
        self.sock.send(encode(msg))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            reply = decode(self.sock.recv())
            if reply.rid == msg.rid:
                return reply
        return None

    def beat(self) -> None:
        """One heartbeat listing the held leases as in progress; not a request (an idle member's beats
        are answered only now and then), so no answer is waited for."""
        self.last_beat = time.monotonic()
        self.rid += 1
        beat = m.Heartbeat(rid=self.rid, loaded={"main": 0}, busy=len(self.held), active=sorted(self.held))
        self.sock.send(encode(beat))

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Run one command; its answer."""
        op = cmd["op"]
        if op == "hello":
            r = self.ask(
                m.Hello(
                    member_id=cmd["member_id"],
                    role=cmd.get("role", "raas"),
                    protocol=m.PROTOCOL_VERSION,
                    policies=["main"],
                    slots=int(cmd.get("slots", 64)),
                    pid=os.getpid(),
                    host="rogue",
                ),
                float(cmd.get("timeout_s", 30.0)),
            )
            self.member = self.member or isinstance(r, m.Welcome)
            return _describe(r)
        if op == "status":
            r = self.ask(m.StatusRequest(), float(cmd.get("timeout_s", 30.0)))
            return _describe(r)
        if op == "lease":
            r = self.ask(m.TaskRequest(n=int(cmd["n"]), loaded={"main": 0}))
            assert isinstance(r, m.TaskGrant), r
            for t in r.tasks:
                self.held[t.task_id] = t.epoch
            return {"type": "TaskGrant", "tasks": [t.task_id for t in r.tasks]}
        if op == "fail":  # every held lease answered with an error, as fast as the acks come
            acks = []
            for task_id, epoch in sorted(self.held.items()):
                r = self.ask(m.TaskResult(task_id=task_id, epoch=epoch, error="RuntimeError: no"))
                assert isinstance(r, m.ResultAck), r
                acks.append(r.status)
            self.held.clear()
            return {"type": "ResultAck", "acks": acks}
        if op == "beat":
            self.beating = bool(cmd["on"])
            return {"type": "ok"}
        if op == "flood":  # heartbeats with one large error, all sent before any reply is read
            return self.flood(int(cmd["n"]), int(cmd["size"]))
        if op == "control":  # an operator key's pause / resume / stop
            return _describe(self.ask(m.Control(action=str(cmd["action"]))))
        if op == "weights":
            return self.pull_weights(str(cmd["addr"]), int(cmd["connections"]), float(cmd["quiet_s"]))
        raise ValueError(f"unknown op {op!r}")

    def flood(self, n: int, size: int) -> dict[str, Any]:
        """n heartbeats with one error, sent at once; the answers that came until none came for 3 s
        (an idle beat within the rate limit is not answered each time)."""
        first = self.rid + 1
        for _ in range(n):
            self.rid += 1
            self.sock.send(encode(m.Heartbeat(rid=self.rid, loaded={"main": 0}, error="E" * size)))
        codes: dict[str, int] = {}
        seen: set[int] = set()
        while len(seen) < n and self.sock.poll(3_000):
            r = decode(self.sock.recv())
            if first <= r.rid <= self.rid and r.rid not in seen:
                seen.add(r.rid)
                key = r.code if isinstance(r, m.Error) else type(r).__name__
                codes[key] = codes.get(key, 0) + 1
        return {"type": "flood", "replies": codes}

    def pull_weights(self, addr: str, connections: int, quiet_s: float) -> dict[str, Any]:
        """Open `connections` connections to a weight server; once every handshake ended, each that
        succeeded asks for version 0's manifest at the same moment and reads nothing more. How many
        handshakes the server refused, and how many connections got an answer before quiet_s passed
        without another."""
        endpoint, _, tail = addr.partition("#curve=")
        server = z85.encode(bytes.fromhex(tail))
        socks = [self._dealer(endpoint, server, "", watch=True) for _ in range(connections)]
        try:
            ok = [i for i, s in enumerate(socks) if self._handshake(s)]
            for i in ok:
                socks[i].send(encode(m.WeightRequest(rid=i + 1, policy="main", version=0)))
            answered: set[int] = set()
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < quiet_s and len(answered) < len(ok):
                for i in ok:
                    if i not in answered and socks[i].poll(5):
                        socks[i].recv()
                        answered.add(i)
                        quiet_since = time.monotonic()
            return {"type": "weights", "refused": connections - len(ok), "answered": len(answered)}
        finally:
            for s in socks:
                s.disable_monitor()
                s.close(0)

    def _handshake(self, sock: zmq.Socket[Any], timeout_s: float = 60.0) -> bool:
        """Wait for a watched socket's CURVE handshake: True once it succeeded, False if refused."""
        mon = self.monitors.pop(id(sock))
        try:
            if not mon.poll(int(timeout_s * 1000)):
                raise TimeoutError("no handshake with the weight server")
            return bool(parse_monitor_message(mon.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED)
        finally:
            mon.close(0)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _describe(r: m.Msg | None) -> dict[str, Any]:
    if r is None:
        return {"type": None}
    out: dict[str, Any] = {"type": type(r).__name__}
    if isinstance(r, m.Error):
        out.update(code=r.code, message=r.message)
    if isinstance(r, m.StatusReply):
        out["members"] = {str(x["id"]): x for x in r.status.get("members", [])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--controller", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--controller-key", required=True)
    ap.add_argument("--routing-id", default="")
    a = ap.parse_args()
    rogue = Rogue(a.controller, load_keypair(Path(a.key)), load_public(a.controller_key), a.routing_id)
    try:
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], 0.2)
            if ready:
                line = sys.stdin.readline()
                if not line:  # the test is done with it: leave as a worker would
                    if rogue.member:
                        rogue.ask(m.Bye(reason="rogue done"), 5.0)
                    return
                try:
                    out = rogue.handle(json.loads(line))
                except Exception as exc:  # the test sees what went wrong in the answer
                    out = {"type": "exception", "error": f"{type(exc).__name__}: {exc}"}
                sys.stdout.write(json.dumps(out) + "\n")
                sys.stdout.flush()
            if rogue.beating and time.monotonic() - rogue.last_beat >= BEAT_S:
                rogue.beat()
    finally:
        rogue.close()


if __name__ == "__main__":
    main()

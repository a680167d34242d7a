"""Simulated members for `astraflow bench control`: many protocol-speaking members in one process.

One process runs a slice of the bench's members on one thread: each member has its own DEALER socket,
routing id (and CURVE key when the bench runs with keys), says Hello, and heartbeats as a real member
does: a working member at the recipe's interval, an idle one at the idle interval its Welcome and
HeartbeatAcks tell (roles/controller/beat_pace.py), saying so in each beat (`next_beat_s`). The
members' due times are one heap, so a process of thousands of members does work per beat, not per
member; an idle member's beat is encoded once per interval and only sent (with its rid 0: the
controller echoes rids and answers heartbeats only now and then), and its socket is read when it is
due, not polled. Members given the `raas` role lease tasks and answer them at once with trivial episodes of
the task's group size (all of a grant in one TaskResults, or one TaskResult each); the `trainer` member takes each batch and announces the next version at once.
No model runs anywhere: what the bench measures is the controller's own cost per message.

Run as `python -m astraflow.bench.control_sim SPEC.json`; the spec and the result are JSON files
(see `SimSpec` and `SimResult`). The process ends when the spec's stop file appears or its
deadline passes, and writes its result file last.
"""

from __future__ import annotations

import heapq
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq

from astraflow.bench.sim_results import episodes, results
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.transport.server import member_keepalive, raise_fd_limit

TASK_WAIT_S = 1.0
"""Long-poll wait of a task request with nothing to lease (the real RaaS waits the same way)."""
BATCH_WAIT_S = 1.0
"""Long-poll wait of a batch request that is not ready yet."""
JOIN_RATE = 250.0
"""Members one simulator process connects and says Hello for per second."""
SLOT_S = 0.25
"""Width of the time slots heartbeats and acks are counted in (`SimResult.beats_by_slot`)."""


@dataclass
class SimSpec:
    """What one simulator process runs."""

    addr: str
    members: list[str]
    roles: dict[str, str]
    """Member id -> raas (leases tasks) | idle (a RaaS that only heartbeats) | trainer."""
    policy: str
    heartbeat_s: float
    slots: int
    deadline: float
    """time.time() at which the process stops at the latest."""
    stop_file: str
    out: str
    keys_dir: str = ""
    """Directory of NAME.key_secret files (one per member) and controller.key; "" = no CURVE."""
    seed: int = 0
    results: str = "grouped"
    """How a grant's tasks are answered, back to back: grouped (one TaskResults), single or tasks."""
    tokens: int = 3
    """Generated tokens of each simulated sequence (after 3 prompt tokens)."""


@dataclass
class SimResult:
    """What one simulator process saw."""

    joined: int = 0
    refused: list[str] = field(default_factory=list)
    heartbeats: int = 0
    acks: int = 0
    """HeartbeatAcks received (an idle member's beat is answered only with news, or every 2 s)."""
    results_sent: int = 0
    sequences_sent: int = 0
    task_latency_s: list[float] = field(default_factory=list)
    """Task request -> a grant that carried tasks."""
    batch_latency_s: list[float] = field(default_factory=list)
    """Batch request -> the ready batch."""
    steps: list[tuple[float, int, int]] = field(default_factory=list)
    """(time.time(), step, samples in its batch) for every version the trainer announced."""
    errors: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    """time.time() of the first Hello and of the stop."""
    beats_by_slot: dict[int, list[int]] = field(default_factory=dict)
    """Slot (int(time.time() / SLOT_S)) -> [heartbeats sent, HeartbeatAcks received] in it: the bench
    counts the beats of its measured window, not those of the joins and of the intervals' ramp."""
    idle_intervals: dict[str, int] = field(default_factory=dict)
    """At the stop: the interval each welcomed idle member beats at (seconds, as text) -> how many."""


class _Member:
    """One simulated member: its socket, role and protocol state."""

    def __init__(self, ctx: zmq.Context[Any], spec: SimSpec, ident: str, keys: Path | None) -> None:
        self.ident = ident
        self.role = spec.roles[ident]
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, ident.encode())
        # the kernel's keepalive a real member's control connection has (transport/client.py)
        member_keepalive(self.sock)
        if keys is not None:
            from astraflow.transport.keys import load_keypair
            from astraflow.transport.security import curve_client

            server = load_keypair(keys / "controller.key_secret").public
            curve_client(self.sock, load_keypair(keys / f"{ident}.key_secret"), server)
        self.hello_sent = False
        self.rid = 0
        self.welcomed = False
        self.version = 0
        self.step = 1
        self.held: set[int] = set()
        self.sent_at: dict[int, tuple[str, float]] = {}
        self.next_beat = 0.0
        self.idle_s = spec.heartbeat_s
        """The idle interval the controller told (Welcome, HeartbeatAck)."""

    def send(self, msg: m.Msg, kind: str = "") -> None:
        self.rid += 1
        msg.rid = self.rid
        if kind:
            self.sent_at[self.rid] = (kind, time.perf_counter())
        self.sock.send(encode(msg), zmq.NOBLOCK)


def simulate(spec: SimSpec) -> SimResult:
    """Run the spec's members until its stop file or deadline; the result of what they saw."""
    res = SimResult()
    rng = random.Random(spec.seed)
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(
        zmq.MAX_SOCKETS, len(spec.members) + 64
    )  # a context option (setsockopt would set a socket default)
    keys = Path(spec.keys_dir) if spec.keys_dir else None
    raise_fd_limit()  # two file descriptors a member (its socket's mailbox and its connection)
    members = [_Member(ctx, spec, ident, keys) for ident in spec.members]
    # an idle member's beat never changes (it pulls no version, works on nothing) but for the interval
    # it announces: encoded once per interval, and the tight loop below only sends it
    idle_beats: dict[float, bytes] = {}
    stop = Path(spec.stop_file)
    now = res.started = time.time()
    # members join at JOIN_RATE a second (thousands of connects at once overflow the listen backlog
    # and the kernel then retries them seconds apart) and beat from their join on, so their beats
    # bunch in the part of each idle interval the joins took (2,000 members in two processes: 4 s of
    # every 10): a window of a few intervals counts one bunch more or less; a heap of due times, so a
    # process of thousands of members does work per beat, not per member
    due = [(now + i / JOIN_RATE, i) for i in range(len(members))]
    heapq.heapify(due)
    # idle members get nothing but replies to their own Hello and beats: each one's socket is read
    # when it is due, with no poller over thousands of sockets (zmq_poll costs per socket per call)
    poller = zmq.Poller()
    for mem in members:
        if mem.role != "idle":
            poller.register(mem.sock, zmq.POLLIN)
    by_sock = {mem.sock: mem for mem in members}
    last_stop_check = 0.0
    try:
        while True:
            now = time.time()
            if now > spec.deadline:
                break
            if now - last_stop_check > 0.2:
                last_stop_check = now
                if stop.exists():
                    break
            while due and due[0][0] <= now:
                _, i = heapq.heappop(due)
                mem = members[i]
                if not mem.hello_sent:
                    _hello(mem, spec)
                    heapq.heappush(due, (now + min(0.2, spec.heartbeat_s), i))
                    continue
                if mem.role == "idle":
                    _drain(mem, spec, res, rng)
                heapq.heappush(due, (now + _beat(mem, spec, res, idle_beats), i))
            wait_ms = 20 if not due else max(0, min(20, int(1000 * (due[0][0] - time.time()))))
            if len(poller.sockets):
                ready = poller.poll(wait_ms)
            else:
                time.sleep(wait_ms / 1000)
                ready = []
            for sock, _ in ready:
                _drain(by_sock[sock], spec, res, rng)
    finally:
        res.ended = time.time()
        for mem in members:
            if mem.role == "idle" and mem.welcomed:
                key = str(max(spec.heartbeat_s, mem.idle_s))
                res.idle_intervals[key] = res.idle_intervals.get(key, 0) + 1
        for mem in members:
            mem.sock.close(0)
        ctx.term()
    return res


def _beat(mem: _Member, spec: SimSpec, res: SimResult, idle_beats: dict[float, bytes]) -> float:
    """One member's heartbeat (none before its Welcome); seconds until it is due again."""
    if not mem.welcomed:  # its Welcome may be on the way: look again soon
        return min(0.2, spec.heartbeat_s)
    gap = spec.heartbeat_s
    if mem.role == "idle":
        gap = max(gap, mem.idle_s)
        beat = idle_beats.get(gap)
        if beat is None:
            beat = idle_beats[gap] = _idle_beat(spec, gap)
        mem.sock.send(beat, zmq.NOBLOCK)
    else:
        mem.send(
            m.Heartbeat(
                loaded={spec.policy: mem.version},
                busy=len(mem.held),
                free=max(0, spec.slots - len(mem.held)),
                active=sorted(mem.held)[:4096],
            )
        )
    res.heartbeats += 1
    res.beats_by_slot.setdefault(int(time.time() / SLOT_S), [0, 0])[0] += 1
    return gap


def _idle_beat(spec: SimSpec, gap: float) -> bytes:
    """An idle member's heartbeat: nothing leased, nothing waiting, no error; the next in `gap` s."""
    beat = m.Heartbeat(loaded={spec.policy: 0}, busy=0, free=spec.slots)
    beat.next_beat_s = gap if gap > spec.heartbeat_s else 0.0
    return encode(beat)


def _hello(mem: _Member, spec: SimSpec) -> None:
    """Connect one member and say Hello."""
    mem.sock.connect(spec.addr)
    mem.hello_sent = True
    mem.send(
        m.Hello(
            member_id=mem.ident,
            role="trainer" if mem.role == "trainer" else "raas",
            protocol=m.PROTOCOL_VERSION,
            policies=[spec.policy],
            slots=spec.slots,
            pid=1,
            host=f"sim-{mem.ident}",
            hardware="simulated",
        )
    )


def _drain(mem: _Member, spec: SimSpec, res: SimResult, rng: random.Random) -> None:
    """Handle every reply waiting on one member's socket."""
    while True:
        try:
            frame = mem.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        _on_reply(mem, decode(frame), spec, res, rng)


def _on_reply(mem: _Member, msg: m.Msg, spec: SimSpec, res: SimResult, rng: random.Random) -> None:
    """Advance one member's protocol on a reply from the controller."""
    sent = mem.sent_at.pop(msg.rid, None)
    took = time.perf_counter() - sent[1] if sent is not None else 0.0
    if isinstance(msg, m.HeartbeatAck):
        res.acks += 1
        res.beats_by_slot.setdefault(int(time.time() / SLOT_S), [0, 0])[1] += 1
        if msg.idle_interval_s > 0:
            mem.idle_s = msg.idle_interval_s
    elif isinstance(msg, m.Error):
        _on_error(mem, msg, res)
    elif isinstance(msg, m.Welcome):
        mem.idle_s = max(msg.idle_interval_s, spec.heartbeat_s)
        _on_welcome(mem, spec, res)
    elif isinstance(msg, m.TaskGrant):
        _on_grant(mem, msg, spec, res, rng, took)
    elif isinstance(msg, m.ResultAck):
        mem.held.discard(msg.task_id)
        if msg.status != "accepted" and len(res.errors) < 20:
            res.errors.append(f"{mem.ident}: task {msg.task_id}: {msg.status}")
    elif isinstance(msg, m.ResultsAck):
        for ack in msg.acks:
            mem.held.discard(ack.task_id)
            if ack.status != "accepted" and len(res.errors) < 20:
                res.errors.append(f"{mem.ident}: task {ack.task_id}: {ack.status} {ack.code} {ack.message}")
    elif isinstance(msg, m.BatchReply):
        _on_batch(mem, msg, spec, res, took)
    elif isinstance(msg, m.Ack) and sent is not None and sent[0] == "version":
        mem.version = mem.step
        mem.step += 1
        mem.send(m.BatchRequest(policy=spec.policy, step=mem.step, wait_s=BATCH_WAIT_S), "batch")


def _on_error(mem: _Member, msg: m.Error, res: SimResult) -> None:
    """A refused Hello counts as refused; any later error is kept (the first 20)."""
    if not mem.welcomed:
        res.refused.append(f"{mem.ident}: {msg.code}: {msg.message}")
    elif len(res.errors) < 20:
        res.errors.append(f"{mem.ident}: {msg.code}: {msg.message}")


def _on_welcome(mem: _Member, spec: SimSpec, res: SimResult) -> None:
    """Joined: a worker asks for tasks, the trainer for its first batch (heartbeat-only members wait)."""
    mem.welcomed = True
    res.joined += 1
    if mem.role == "raas":
        mem.send(m.TaskRequest(n=spec.slots, loaded={spec.policy: 0}, wait_s=TASK_WAIT_S), "task")
    elif mem.role == "trainer":
        mem.send(m.BatchRequest(policy=spec.policy, step=mem.step, wait_s=BATCH_WAIT_S), "batch")


def _on_grant(
    mem: _Member, msg: m.TaskGrant, spec: SimSpec, res: SimResult, rng: random.Random, took: float
) -> None:
    """Answer every granted task at once (one message, or one each: spec.results), then ask for more."""
    for v in msg.versions:
        if v.policy == spec.policy:
            mem.version = max(mem.version, v.version)
    if msg.stop:
        return
    if msg.tasks:
        res.task_latency_s.append(took)
    for task in msg.tasks:
        mem.held.add(task.task_id)
    if spec.results == "grouped" and msg.tasks:
        sent = results(msg.tasks, spec.policy, mem.version, rng, spec.tokens)
        mem.send(sent)
        res.results_sent += len(msg.tasks)
        res.sequences_sent += sum(sum(h.episodes) for h in sent.results)
    for task in msg.tasks if spec.results != "grouped" else []:
        if spec.results == "tasks":
            one = results([task], spec.policy, mem.version, rng, spec.tokens)
            mem.send(one)
            res.sequences_sent += sum(one.results[0].episodes)
        else:
            eps = episodes(task, spec.policy, mem.version, rng, spec.tokens)
            mem.send(m.TaskResult(task_id=task.task_id, epoch=task.epoch, episodes=eps))
            res.sequences_sent += len(eps)
        res.results_sent += 1
    mem.send(m.TaskRequest(n=spec.slots, loaded={spec.policy: mem.version}, wait_s=TASK_WAIT_S), "task")


def _on_batch(mem: _Member, msg: m.BatchReply, spec: SimSpec, res: SimResult, took: float) -> None:
    """The trainer: a ready batch is trained at once (its version announced); not ready, ask again."""
    if msg.done:
        return
    if not msg.ready:
        mem.send(m.BatchRequest(policy=spec.policy, step=mem.step, wait_s=BATCH_WAIT_S), "batch")
        return
    res.batch_latency_s.append(took)
    res.steps.append((time.time(), msg.step, msg.columns.count))
    mem.send(
        m.VersionPublished(policy=spec.policy, version=msg.step, step=msg.step, weights_addr=""),
        "version",
    )


def main(argv: list[str]) -> int:
    """Entry point: read the spec, simulate, write the result."""
    spec = SimSpec(**json.loads(Path(argv[1]).read_text()))
    res = simulate(spec)
    tmp = Path(spec.out + ".tmp")
    tmp.write_text(json.dumps(asdict(res)))
    tmp.replace(spec.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""A control-plane member written from docs/protocol.md alone, as an outside user would write one.

It uses only pyzmq, a msgpack codec and the standard library: nothing of astraflow. Every message is
a msgpack map with a "type" key naming the message and the message's fields ("Framing"); the DEALER
sends one frame and gets one frame back; replies echo the request's `rid` ("Requests, replies and
`rid`"). Data carried inside messages (ResultHead, SequenceColumns, SamplingParams, Task, ...) are
plain maps of their fields, with no "type" key. Per-token arrays travel as little-endian packed bytes
("Packed per-token arrays"); a TaskResults carries its sequences as columns ("Columns per message") and
a BatchReply its samples as SampleColumns ("Batches as columns").

The plain `msgpack` package is used when it is installed; otherwise msgspec's msgpack encoder and
decoder, on plain dicts, lists and scalars only (no astraflow struct)."""

from __future__ import annotations

import os
import secrets
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

try:
    import msgpack as plain_msgpack
except ImportError:  # the venv has no plain msgpack: msgspec's codec, on plain values only
    plain_msgpack = None


def pack(obj: Any) -> bytes:
    if plain_msgpack is not None:
        return bytes(plain_msgpack.packb(obj, use_bin_type=True))
    import msgspec

    return msgspec.msgpack.encode(obj)


def unpack(data: bytes) -> Any:
    if plain_msgpack is not None:
        return plain_msgpack.unpackb(data, raw=False, strict_map_key=False)
    import msgspec

    return msgspec.msgpack.decode(data)


PROTOCOL = 10
"""The protocol version docs/protocol.md describes."""


@dataclass
class Curve:
    """The three Z85 keys a CURVE client needs ("Authentication (CURVE)"; docs/operations.md): its
    own pair, from NAME.key_secret, and the controller's public key, from controller.key."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def from_files(cls, secret_file: Path, controller_key: Path) -> Curve:
        import zmq.auth

        public, secret = zmq.auth.load_certificate(str(secret_file))
        server, _ = zmq.auth.load_certificate(str(controller_key))
        assert secret is not None
        return cls(public=public, secret=secret, server=server)


@dataclass
class RawMember:
    """One DEALER connection to the controller, speaking the protocol by hand."""

    ctx: zmq.Context
    addr: str
    member_id: str
    curve: Curve | None = None
    sock: zmq.Socket = field(init=False)
    rid: int = 0
    slots: int = 0
    beat_every_s: float = 0.5
    next_beat: float = 0.0
    active: list[int] = field(default_factory=list)
    loaded: dict[str, int] = field(default_factory=dict)
    unsolicited: list[dict[str, Any]] = field(default_factory=list)
    """Replies to heartbeats (HeartbeatAck or Error) read while waiting for something else."""

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.curve is None:
            # "Sockets and identities": without keys the routing id is the member id
            self.sock.setsockopt(zmq.IDENTITY, self.member_id.encode())
        else:
            # with keys: a random routing id per connection, `<member id>.<16 hex>`
            self.sock.setsockopt(zmq.IDENTITY, f"{self.member_id}.{secrets.token_hex(8)}".encode())
            self.sock.curve_serverkey = self.curve.server
            self.sock.curve_publickey = self.curve.public
            self.sock.curve_secretkey = self.curve.secret
        self.sock.connect(self.addr)

    def close(self) -> None:
        self.sock.close(0)

    # -- wire ---------------------------------------------------------------------------------------

    def send(self, type_: str, flags: int = 0, **fields: Any) -> int:
        """Send one message (zmq send `flags`); returns its rid."""
        self.rid += 1
        self.sock.send(pack({"type": type_, "rid": self.rid, **fields}), flags)
        return self.rid

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        msg = unpack(self.sock.recv())
        assert isinstance(msg, dict) and isinstance(msg.get("type"), str), msg
        return msg

    def wait_for(self, rid: int, timeout_s: float = 10.0) -> dict[str, Any]:
        """The reply with this rid, heartbeating meanwhile (a heartbeat's answers are kept aside)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.beat_if_due()
            msg = self.recv(min(0.05, max(0.0, deadline - time.monotonic())))
            if msg is None:
                continue
            if msg["rid"] == rid:
                return msg
            self.unsolicited.append(msg)
            self.learn(msg)
        raise AssertionError(f"{self.member_id}: no reply to rid {rid} within {timeout_s} s")

    def ask(self, type_: str, timeout_s: float = 10.0, **fields: Any) -> dict[str, Any]:
        return self.wait_for(self.send(type_, **fields), timeout_s)

    # -- membership ---------------------------------------------------------------------------------

    def hello(
        self, role: str, policies: list[str], slots: int = 0, protocol: int = PROTOCOL
    ) -> dict[str, Any]:
        self.slots = slots
        reply = self.ask(
            "Hello",
            member_id=self.member_id,
            role=role,
            protocol=protocol,
            policies=policies,
            region="",
            hardware="cpu:1",
            slots=slots,
            pid=os.getpid(),
            host="raw-member-host",
        )
        if reply["type"] == "Welcome":
            if reply["heartbeat_interval_s"] > 0:
                self.beat_every_s = reply["heartbeat_interval_s"]
            self.learn(reply)
        return reply

    def heartbeat(self) -> int:
        """One Heartbeat ("Heartbeats, liveness and the hang watchdog"): not a request, so nothing is
        awaited; `active` lists the leases to renew."""
        self.next_beat = time.monotonic() + self.beat_every_s
        busy = len(self.active)
        return self.send(
            "Heartbeat",
            loaded=dict(self.loaded),
            busy=busy,
            free=max(0, self.slots - busy),
            active=list(self.active),
            error="",
            waiting=[],
            relay_addr="",
            next_beat_s=0.0,
        )

    def beat_if_due(self) -> None:
        if self.next_beat and time.monotonic() >= self.next_beat:
            self.heartbeat()

    def bye(self, reason: str) -> dict[str, Any]:
        self.next_beat = 0.0
        return self.ask("Bye", reason=reason)

    def learn(self, msg: dict[str, Any]) -> None:
        """Keep the newest version of each policy that a Welcome, TaskGrant or HeartbeatAck names."""
        for info in msg.get("versions") or []:
            if info["version"] > self.loaded.get(info["policy"], -1):
                self.loaded[info["policy"]] = info["version"]


# -- results as columns ("Columns per message") -------------------------------------------------------


@dataclass
class Seq:
    """One generated sequence, as a workflow would report it."""

    policy: str
    role: str
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    sampling: dict[str, Any]
    group_key: str = ""


def _index(table: list[Any], value: Any) -> int:
    if value not in table:
        table.append(value)
    return table.index(value)


def task_results(
    results: list[tuple[dict[str, Any], list[list[Seq]], dict[int, dict[str, Any]]]],
) -> dict[str, Any]:
    """The fields of a TaskResults: one ResultHead per (task, episodes, infos) and one SequenceColumns
    holding every sequence of the message in order (result by result, episode by episode)."""
    heads: list[dict[str, Any]] = []
    seqs: list[Seq] = []
    for task, episodes, infos in results:
        heads.append(
            {
                "task_id": task["task_id"],
                "epoch": task["epoch"],
                "episodes": [len(e) for e in episodes],
                "infos": infos,
                "error": "",
            }
        )
        seqs += [s for e in episodes for s in e]
    names: list[str] = []
    keys: list[str] = []
    samplings: list[dict[str, Any]] = []
    policy = [_index(names, s.policy) for s in seqs]
    role = [_index(names, s.role) for s in seqs]
    group = [_index(keys, s.group_key) for s in seqs]
    sampling = [_index(samplings, s.sampling) for s in seqs]
    columns = {
        "lengths": _i32([len(s.tokens) for s in seqs]),
        "tokens": _i32([t for s in seqs for t in s.tokens]),
        "loss_mask": bytes(m for s in seqs for m in s.loss_mask),
        "logprobs": _f32([lp for s in seqs for lp in s.logprobs]),
        "versions": _i32([v for s in seqs for v in s.versions]),
        "rewards": struct.pack(f"<{len(seqs)}d", *(s.reward for s in seqs)),
        "policy": _i32(policy),
        "role": _i32(role),
        "group_key": _i32(group),
        "sampling": _i32(sampling),
        "names": names,
        "keys": keys,
        "samplings": samplings,
        "turns": {},
    }
    return {"results": heads, "columns": columns}


def packed_episode(seqs: list[Seq], info: dict[str, Any]) -> dict[str, Any]:
    """A PackedEpisode, as a TaskResult carries it ("Packed per-token arrays")."""
    return {
        "sequences": [
            {
                "policy": s.policy,
                "tokens": _i32(s.tokens),
                "loss_mask": bytes(s.loss_mask),
                "logprobs": _f32(s.logprobs),
                "versions": _i32(s.versions),
                "sampling": s.sampling,
                "reward": s.reward,
                "role": s.role,
                "group_key": s.group_key,
            }
            for s in seqs
        ],
        "info": info,
    }


def _i32(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


# -- batches as columns ("Batches as columns") ----------------------------------------------------------


@dataclass
class Sample:
    """One sample cut from a BatchReply's SampleColumns."""

    traj_id: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    advantage: float
    replay: bool
    sampling: dict[str, Any]


def samples(columns: dict[str, Any]) -> list[Sample]:
    """Cut a SampleColumns into its samples, checking the layout the doc gives."""
    n = len(columns["traj_ids"]) // 8
    traj_ids = struct.unpack(f"<{n}q", columns["traj_ids"])
    lengths = struct.unpack(f"<{n}i", columns["lengths"])
    rewards = struct.unpack(f"<{n}d", columns["rewards"])
    advantages = struct.unpack(f"<{n}d", columns["advantages"])
    replay = list(columns["replay"])
    chunks = struct.unpack(f"<{len(columns['chunks']) // 4}i", columns["chunks"])
    runs = struct.unpack(f"<{len(columns['sampling_runs']) // 4}i", columns["sampling_runs"])
    assert sum(chunks) == n and sum(runs) == n and len(runs) == len(columns["samplings"])
    for name in ("tokens", "loss_mask", "logprobs", "versions"):
        assert len(columns[name]) == len(chunks), name
    sampling = [s for s, r in zip(columns["samplings"], runs, strict=True) for _ in range(r)]
    out: list[Sample] = []
    start = 0
    for j, count in enumerate(chunks):
        t = 0
        for k in range(start, start + count):
            ln = lengths[k]
            out.append(
                Sample(
                    traj_id=traj_ids[k],
                    tokens=list(struct.unpack_from(f"<{ln}i", columns["tokens"][j], 4 * t)),
                    loss_mask=list(columns["loss_mask"][j][t : t + ln]),
                    logprobs=list(struct.unpack_from(f"<{ln}f", columns["logprobs"][j], 4 * t)),
                    versions=list(struct.unpack_from(f"<{ln}i", columns["versions"][j], 4 * t)),
                    reward=rewards[k],
                    advantage=advantages[k],
                    replay=bool(replay[k]),
                    sampling=sampling[k],
                )
            )
            t += ln
        assert t * 4 == len(columns["tokens"][j]), "a chunk holds exactly its samples' tokens"
        start += count
    return out

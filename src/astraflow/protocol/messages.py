"""Every message of the control plane and the weight data plane, as typed msgspec structs.

Each struct is tagged by its class name (the msgpack map carries "type"), unknown fields are
rejected, and `rid` pairs a reply with its request. docs/protocol.md documents each one.
"""

from __future__ import annotations

from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    """Base of every message: `rid` is chosen by the requester and echoed in the reply."""

    rid: int = 0


# ----- data carried inside messages -----------------------------------------------------------


class Sequence(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One token sequence of one policy in an episode; the unit a trainer consumes."""

    policy: str
    tokens: list[int]
    """Prompt and generated tokens, in order (multi-turn: the whole conversation)."""
    loss_mask: list[int]
    """1 on tokens this policy generated and trains on, 0 elsewhere; len == len(tokens)."""
    logprobs: list[float]
    """Behaviour logprob of each token under the engine that sampled it (0.0 where mask is 0)."""
    versions: list[int]
    """Policy version that produced each token (-1 where mask is 0)."""
    reward: float = 0.0
    """Scalar reward of this sequence."""
    temperature: float = 1.0
    """Sampling temperature the engine used for this sequence's generated tokens."""
    top_p: float = 1.0
    """Nucleus mass the engine sampled with (1.0: off)."""
    top_k: int = 0
    """Top-k the engine sampled with (0: off)."""
    turns: list[tuple[int, int, bool]] | None = None
    """Policy turns as (start index, generated tokens, truncated); None: derived from loss_mask runs."""


class Episode(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One run of a workflow on one sample: sequences for one or more policies."""

    sequences: list[Sequence]
    info: dict[str, Any] = {}
    """Free-form numbers a workflow reports (e.g. correctness, turns); scalars only."""


class VersionInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The newest published version of a policy and where to pull it."""

    policy: str
    version: int
    weights_addr: str
    """ZeroMQ endpoint of the weight server that serves this version ("" = initial weights on disk)."""
    sha256: str = ""


class Task(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One prompt and its whole group, leased to one RaaS."""

    task_id: int
    epoch: int
    """Lease epoch; a result must echo it and is rejected if the task was re-leased since."""
    sample: dict[str, Any]
    group_size: int
    roles: dict[str, str]
    """Workflow role -> policy name."""


class TrainSample(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One sequence as a trainer receives it, with its group advantage."""

    traj_id: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    advantage: float
    replay: bool = False
    temperature: float = 1.0
    """Sampling settings of the behaviour distribution: the trainer recomputes logprobs under them."""
    top_p: float = 1.0
    top_k: int = 0


# ----- membership --------------------------------------------------------------------------------


class Hello(Msg, kw_only=True):
    """First message of a member: who it is and what it serves."""

    member_id: str
    role: str
    """raas | trainer | observer"""
    protocol: int
    policies: list[str] = []
    region: str = ""
    hardware: str = ""
    slots: int = 0
    pid: int = 0
    host: str = ""


class Welcome(Msg, kw_only=True):
    """The controller's answer to Hello: the run's recipe and current versions."""

    run_name: str
    recipe: dict[str, Any]
    heartbeat_interval_s: float
    versions: list[VersionInfo] = []


class Heartbeat(Msg, kw_only=True):
    """Liveness and load of a member; also renews its leases."""

    loaded: dict[str, int] = {}
    """Policy -> version the member's engine holds now."""
    busy: int = 0
    free: int = 0


class HeartbeatAck(Msg, kw_only=True):
    """Reply to Heartbeat: newest versions, and whether the member should stop."""

    versions: list[VersionInfo] = []
    stop: bool = False


class Bye(Msg, kw_only=True):
    """A member leaves; its leases return to the queue at once."""

    reason: str = ""


# ----- rollout -----------------------------------------------------------------------------------


class TaskRequest(Msg, kw_only=True):
    """A RaaS asks for up to n tasks (its free slots): credit-based flow control."""

    n: int
    loaded: dict[str, int] = {}


class TaskGrant(Msg, kw_only=True):
    """Zero or more leased tasks; with none, retry after retry_after_s."""

    tasks: list[Task] = []
    versions: list[VersionInfo] = []
    retry_after_s: float = 0.0
    stop: bool = False


class TaskResult(Msg, kw_only=True):
    """The episodes of a leased task (or the error that ended it)."""

    task_id: int
    epoch: int
    episodes: list[Episode] = []
    error: str = ""


class ResultAck(Msg, kw_only=True):
    """Reply to TaskResult: accepted | duplicate | stale_epoch | unknown_task | failed."""

    task_id: int
    status: str


# ----- training ----------------------------------------------------------------------------------


class BatchRequest(Msg, kw_only=True):
    """A trainer asks for the batch of its policy's step `step` (1-based)."""

    policy: str
    step: int


class BatchReply(Msg, kw_only=True):
    """The recorded batch for a step, or not ready yet (retry), or done (budget reached)."""

    policy: str
    step: int
    samples: list[TrainSample] = []
    ready: bool = False
    done: bool = False
    retry_after_s: float = 0.0


class VersionPublished(Msg, kw_only=True):
    """A trainer finished step `step`, producing `version`, now served at weights_addr."""

    policy: str
    version: int
    step: int
    weights_addr: str
    sha256: str = ""
    nbytes: int = 0
    metrics: dict[str, float] = {}


class Ack(Msg, kw_only=True):
    """Generic success reply."""

    detail: str = ""


class Error(Msg, kw_only=True):
    """Generic failure reply: code is machine-readable, message is for people."""

    code: str
    message: str = ""


class StatusRequest(Msg, kw_only=True):
    """Ask the controller for the status document (same schema as `astraflow status --json`)."""


class StatusReply(Msg, kw_only=True):
    """The status document."""

    status: dict[str, Any]


# ----- weight data plane -------------------------------------------------------------------------


class WeightRequest(Msg, kw_only=True):
    """Ask a weight server for a version's manifest (chunk = -1) or one chunk."""

    policy: str
    version: int
    chunk: int = -1
    kind: str = "full"
    """Which blob of that version: "full" (a snapshot) or "delta" (from the previous version)."""


class WeightManifest(Msg, kw_only=True):
    """How a version is laid out: total size, chunking and checksums."""

    policy: str
    version: int
    kind: str = "full"
    format: str = "safetensors"
    nbytes: int
    chunk_bytes: int
    chunk_sha256: list[str]
    sha256: str


class WeightChunk(Msg, kw_only=True):
    """One chunk of a version's bytes."""

    policy: str
    version: int
    index: int
    data: bytes


Message = (
    Hello
    | Welcome
    | Heartbeat
    | HeartbeatAck
    | Bye
    | TaskRequest
    | TaskGrant
    | TaskResult
    | ResultAck
    | BatchRequest
    | BatchReply
    | VersionPublished
    | Ack
    | Error
    | StatusRequest
    | StatusReply
    | WeightRequest
    | WeightManifest
    | WeightChunk
)

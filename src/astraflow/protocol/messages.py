"""Every message of the control plane and the weight data plane, as typed msgspec structs.

Each struct is tagged by its class name (the msgpack map carries "type"), unknown fields are
rejected, and `rid` pairs a reply with its request. docs/protocol.md documents each one.

Over 400 lines because every message of the protocol is here: one source for the wire format,
which docs/protocol.md documents struct by struct.
"""

from __future__ import annotations

import collections.abc
import math
from typing import Annotated, Any

import msgspec

from astraflow.protocol import packed

PROTOCOL_VERSION = 10

# Caps on what a peer may send, checked by the decoder before a message reaches a handler
# (docs/protocol.md "Limits"); frames as a whole are capped by the transport's MAXMSGSIZE.
Name = Annotated[str, msgspec.Meta(max_length=255)]
"""A member id, policy, role or host name."""
Text = Annotated[str, msgspec.Meta(max_length=64 << 10)]
"""A free-form reason or error text."""
Scalar = str | int | float | bool | None
"""A value of an episode's info: scalars only, so no peer can nest data inside it."""


class Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    """Base of every message: `rid` is chosen by the requester and echoed in the reply."""

    rid: int = 0


# ----- data carried inside messages -----------------------------------------------------------

MIN_TEMPERATURE = 0.01
"""Lowest sampling temperature anything accepts: the trainer scales logits by 1 / temperature in
float32, and lower values (1e-300) overflow it; greedy decoding has no behaviour logprobs at all."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The settings that shape the distribution an engine samples each token from.

    The engine reports the ones it used on every completion; the Sequence carries them to the trainer,
    which recomputes logprobs under exactly these (engines/sampling.py). Settings that do not change the
    per-token distribution (max_new_tokens, stop tokens, seed) are not part of it."""

    temperature: float = 1.0
    """Softmax temperature (at least MIN_TEMPERATURE)."""
    top_p: float = 1.0
    """Nucleus mass, in (0, 1] (1.0: off)."""
    top_k: int = 0
    """Keep only the k most likely tokens before top-p (0: off)."""

    def problem(self) -> str:
        """Why these settings cannot be sampled from and trained on ('' when they can)."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if not (isinstance(t, float | int) and math.isfinite(t) and t >= MIN_TEMPERATURE):
            return (
                f"temperature {t!r} is not a finite number >= {MIN_TEMPERATURE} (the trainer divides "
                "the logits by it in float32)"
            )
        if not (isinstance(p, float | int) and 0.0 < p <= 1.0):
            return f"top_p {p!r} is not in (0, 1]"
        if not (isinstance(k, int) and 0 <= k < 1 << 31):
            # the upper bound keeps it inside SQLite's and torch's integers (no vocabulary is larger)
            return f"top_k {k!r} is not an integer in [0, 2**31)"
        return ""

    def filtered(self) -> bool:
        """Whether top-p or top-k cuts the distribution (a top_k at or above the vocabulary counts)."""
        return self.top_p < 1.0 or self.top_k > 0


class Sequence(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One token sequence of one policy in an episode; the unit a trainer consumes."""

    policy: Name
    tokens: list[int]
    """Prompt and generated tokens, in order (multi-turn: the whole conversation)."""
    loss_mask: list[int]
    """1 on tokens this policy generated and trains on, 0 elsewhere; len == len(tokens)."""
    logprobs: list[float]
    """Behaviour logprob of each token under the engine that sampled it (0.0 where mask is 0)."""
    versions: list[int]
    """Policy version that produced each token (-1 where mask is 0)."""
    sampling: SamplingParams
    """The settings the engine reported for this sequence's generated tokens (the completion's own;
    a Transcript refuses turns that differ); the trainer recomputes logprobs under them."""
    reward: float = 0.0
    """Scalar reward of this sequence."""
    role: Name = ""
    """Workflow role that produced this sequence ("" = not said); per-role metrics and baselines use it."""
    group_key: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """Comparison set inside the task (e.g. the sub-problem a solver answered); advantages are computed
    over (task, policy, group_key); "" = the task's whole group (in self-play: the role)."""
    turns: Annotated[list[tuple[int, int, bool]], msgspec.Meta(max_length=65536)] | None = None
    """Policy turns as (start index, generated tokens, truncated); None: derived from loss_mask runs."""


MAX_PACKED_BYTES = 1 << 26
"""Most bytes of one packed per-token field (16 Mi tokens of int32); frames are capped lower still."""
Packed = Annotated[bytes, msgspec.Meta(max_length=MAX_PACKED_BYTES)]
"""A packed per-token array (protocol/packed.py): int32, uint8 or float32, little-endian."""


class PackedSequence(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A Sequence as it travels in a result and is stored: its per-token lists as packed arrays.

    Built from a Sequence by `of`; the controller checks the arrays without turning them into lists
    (dataflow/validate.py), and a size that is not a whole number of items is refused there."""

    policy: Name
    tokens: Packed
    """int32 little-endian token ids."""
    loss_mask: Packed
    """uint8, one per token: 1 on trained tokens, 0 elsewhere."""
    logprobs: Packed
    """float32 little-endian behaviour logprobs, one per token."""
    versions: Packed
    """int32 little-endian policy version of each token (-1 where the mask is 0)."""
    sampling: SamplingParams
    """As in Sequence."""
    reward: float = 0.0
    """As in Sequence."""
    role: Name = ""
    """As in Sequence."""
    group_key: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """As in Sequence."""
    turns: Annotated[list[tuple[int, int, bool]], msgspec.Meta(max_length=65536)] | None = None
    """As in Sequence."""

    @classmethod
    def of(cls, s: Sequence) -> PackedSequence:
        """The packed form of a sequence (ValueError naming the field when a value does not fit its type)."""
        return cls(
            policy=s.policy,
            tokens=packed.pack_ints("tokens", s.tokens),
            loss_mask=packed.pack_mask(s.loss_mask),
            logprobs=packed.pack_floats("logprobs", s.logprobs),
            versions=packed.pack_ints("versions", s.versions),
            sampling=s.sampling,
            reward=s.reward,
            role=s.role,
            group_key=s.group_key,
            turns=s.turns,
        )

    def unpack(self) -> Sequence:
        """The Sequence these arrays hold (ValueError when a size is not a whole number of items)."""
        return Sequence(
            policy=self.policy,
            tokens=packed.ints(self.tokens),
            loss_mask=list(self.loss_mask),
            logprobs=packed.floats(self.logprobs),
            versions=packed.ints(self.versions),
            sampling=self.sampling,
            reward=self.reward,
            role=self.role,
            group_key=self.group_key,
            turns=self.turns,
        )


class Episode(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One run of a workflow on one sample: sequences for one or more policies."""

    sequences: Annotated[list[Sequence], msgspec.Meta(max_length=4096)]
    info: Annotated[dict[Name, Scalar], msgspec.Meta(max_length=256)] = {}
    """Free-form numbers a workflow reports (e.g. correctness, turns); scalars only."""


class PackedEpisode(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An Episode as it travels in a result: its sequences packed."""

    sequences: Annotated[list[PackedSequence], msgspec.Meta(max_length=4096)]
    info: Annotated[dict[Name, Scalar], msgspec.Meta(max_length=256)] = {}
    """As in Episode."""

    @classmethod
    def of(cls, ep: Episode | PackedEpisode) -> PackedEpisode:
        """The packed form of an episode (itself when packed already); a value that does not fit its
        type raises ValueError naming the sequence and the field."""
        if isinstance(ep, PackedEpisode):
            return ep
        out = []
        for j, s in enumerate(ep.sequences):
            try:
                out.append(s if isinstance(s, PackedSequence) else PackedSequence.of(s))
            except ValueError as exc:
                raise ValueError(f"sequence {j}: {exc}") from None
        return cls(sequences=out, info=ep.info)


AnyEpisodes = collections.abc.Sequence[Episode | PackedEpisode]
"""Episodes of Python lists (built in process) or packed (decoded from the wire)."""


def pack_episodes(episodes: AnyEpisodes) -> list[PackedEpisode]:
    """Episodes in their packed form (those already packed as they are); ValueError names the episode,
    sequence and field of a value that does not fit its type."""
    out = []
    for i, ep in enumerate(episodes):
        if type(ep) is PackedEpisode:
            out.append(ep)
            continue
        try:
            out.append(PackedEpisode.of(ep))
        except ValueError as exc:
            raise ValueError(f"episode {i} {exc}") from None
    return out


class WeightOffer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A faster path than the weight server by which a trainer offers one version (weights/transport.py);
    a worker takes the first offer it can use and falls back to the ZeroMQ pull."""

    kind: Annotated[str, msgspec.Meta(max_length=16)]
    """shm (shared memory on the trainer's host) | cuda_ipc (the trainer's GPU buffer) | broadcast."""
    host: Name = ""
    """shm, cuda_ipc: the trainer's host id (host name and boot id); other hosts cannot use the offer."""
    path: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """shm, cuda_ipc: the slot file in /dev/shm (header, layout table, and on a CPU the bytes)."""
    ipc: Annotated[bytes, msgspec.Meta(max_length=4096)] = b""
    """cuda_ipc: the packed device buffer's CUDA IPC handle."""
    address: Name = ""
    """broadcast: host:port of the trainer's rendezvous store."""
    token: Name = ""
    """broadcast: the secret key prefix a worker needs to join the trainer's broadcast groups."""
    digest: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """The packed buffer's checksum (weights/packed.py `digest`), checked before the weights apply."""


class VersionInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The newest published version of a policy and where to pull it."""

    policy: str
    version: int
    weights_addr: str
    """ZeroMQ endpoint of the weight server that serves this version ("" = initial weights on disk)."""
    sha256: str = ""
    relays: list[str] = []
    """Weight servers of peers in the receiver's region that hold this version or are fetching it
    (`[weights] relays`): pull from them first, from `weights_addr` when they fail."""
    offers: Annotated[list[WeightOffer], msgspec.Meta(max_length=8)] = []
    """Faster paths for this version, fastest first ([] = the weight server only)."""


class Task(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One prompt and its whole group, leased to one RaaS."""

    task_id: int
    epoch: int
    """Lease epoch; a result must echo it and is rejected if the task was re-leased since."""
    sample: dict[str, Any]
    group_size: int
    """The largest group size of the task's policies (episodes run when the workflow has no run_group)."""
    roles: dict[str, str]
    """Workflow role -> policy name."""
    group_sizes: dict[str, int] = {}
    """Policy -> its group size (samples compared per group); {} = group_size for every policy."""
    read_only: list[str] = []
    """Policies of this task whose sequences are not trained on (frozen, or their budget is met)."""
    sampling: dict[str, float | int] = {}
    """Sampling overrides for every generate call of this task (held-out evaluation: eval.sampling);
    a workflow's own per-call overrides win over them."""


class TrainSample(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One sequence as a trainer receives it, with its group advantage; its per-token data packed as
    it was stored (PackedSequence's layout). Lists given in process are packed on construction."""

    traj_id: int
    tokens: Packed
    """int32 little-endian token ids."""
    loss_mask: Packed
    """uint8, one per token."""
    logprobs: Packed
    """float32 little-endian behaviour logprobs."""
    versions: Packed
    """int32 little-endian versions."""
    reward: float
    advantage: float
    sampling: SamplingParams
    """Sampling settings of the behaviour distribution: the trainer recomputes logprobs under them."""
    replay: bool = False

    def __post_init__(self) -> None:
        if type(self.tokens) is not bytes:
            self.tokens = packed.pack_ints("tokens", self.tokens)
        if type(self.loss_mask) is not bytes:
            self.loss_mask = packed.pack_mask(self.loss_mask)
        if type(self.logprobs) is not bytes:
            self.logprobs = packed.pack_floats("logprobs", self.logprobs)
        if type(self.versions) is not bytes:
            self.versions = packed.pack_ints("versions", self.versions)

    @property
    def length(self) -> int:
        """Tokens in the sample."""
        return len(self.tokens) // 4

    def token_list(self) -> list[int]:
        """The token ids as Python ints."""
        return packed.ints(self.tokens)

    def mask_list(self) -> list[int]:
        """The loss mask as Python ints."""
        return list(self.loss_mask)

    def logprob_list(self) -> list[float]:
        """The behaviour logprobs as Python floats (float32 values)."""
        return packed.floats(self.logprobs)

    def version_list(self) -> list[int]:
        """The versions as Python ints."""
        return packed.ints(self.versions)


# ----- membership --------------------------------------------------------------------------------


class Hello(Msg, kw_only=True):
    """First message of a member: who it is and what it serves."""

    member_id: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    role: Annotated[str, msgspec.Meta(max_length=32)]
    """raas | trainer | observer"""
    protocol: int
    policies: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    region: Annotated[str, msgspec.Meta(max_length=128)] = ""
    hardware: Name = ""
    slots: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    pid: int = 0
    host: Name = ""


class Welcome(Msg, kw_only=True):
    """The controller's answer to Hello: the recipe's sections the member's role reads, and the current
    versions."""

    run_name: str
    sections: dict[str, Any]
    """What the member's role reads of the recipe (roles/member_sections.py): a raas RaaSSections, a
    trainer TrainerSections, an observer nothing; never the whole recipe."""
    heartbeat_interval_s: float
    versions: list[VersionInfo] = []
    idle_interval_s: float = 0.0
    """Seconds between the beats of this member while it is idle (no lease, no request the controller
    does not hold, no new error); 0: heartbeat_interval_s."""


class Heartbeat(Msg, kw_only=True):
    """Liveness and load of a member; also renews its leases."""

    loaded: Annotated[dict[Name, int], msgspec.Meta(max_length=64)] = {}
    """Policy -> version the member's engine holds now."""
    busy: int = 0
    free: int = 0
    active: Annotated[list[int], msgspec.Meta(max_length=4096)] = []
    """Task ids the member is working on now: only these leases are renewed."""
    error: Text = ""
    """The member's newest failure it survived (e.g. weights it could not apply); logged by the controller."""
    waiting: Annotated[list[int], msgspec.Meta(max_length=256)] = []
    """rids of requests sent before this heartbeat, on this connection, still unanswered."""
    relay_addr: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """The member's relay weight server, which serves the versions it holds to peers ("" = none)."""
    next_beat_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Seconds until this member's next heartbeat (0: heartbeat_interval_s): the controller declares it
    dead after the same number of missed beats (at most the idle cap's, roles/controller/beat_pace.py)."""


class HeartbeatAck(Msg, kw_only=True):
    """Answer to a Heartbeat, when the member has something to learn: newest versions, whether to
    stop, requests the controller never got, a new idle interval; an idle member's beats get one at
    least every 2 s or every beat when it beats less often (roles/controller/beats.py), not one each."""

    versions: list[VersionInfo] = []
    stop: bool = False
    lost: list[int] = []
    """The heartbeat's `waiting` rids this controller neither answered nor holds: it never got them
    (it restarted, or they died with a connection). No answer will come; the member asks again."""
    idle_interval_s: float = 0.0
    """The member's idle interval from now on (as Welcome.idle_interval_s; 0: unchanged)."""


class Bye(Msg, kw_only=True):
    """A member leaves; its leases return to the queue at once."""

    reason: Text = ""


class Leave(Msg, kw_only=True):
    """Ask the controller to drain a RaaS: it gets no new tasks, finishes or returns its leases, leaves."""

    member_id: Name


class Control(Msg, kw_only=True):
    """An operator's command (`astraflow ctl`, the dashboard): pause or resume admission, or stop the run."""

    action: Annotated[str, msgspec.Meta(max_length=16)]
    """pause | resume | stop"""
    policy: Name = ""
    """pause/resume: only this policy's admission; "" for the whole run."""


# ----- rollout -----------------------------------------------------------------------------------


class TaskRequest(Msg, kw_only=True):
    """A RaaS asks for up to n tasks (its free slots): credit-based flow control."""

    n: int
    loaded: Annotated[dict[Name, int], msgspec.Meta(max_length=64)] = {}
    wait_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """With no task to lease now, the controller may hold the request up to this long (capped) and
    answer as soon as tasks can be leased or a new version is published (a long poll)."""


class TaskGrant(Msg, kw_only=True):
    """Zero or more leased tasks; with none, retry after retry_after_s."""

    tasks: list[Task] = []
    versions: list[VersionInfo] = []
    retry_after_s: float = 0.0
    stop: bool = False


class TaskResult(Msg, kw_only=True):
    """The episodes of a leased task (or the error that ended it). Episodes built in process are
    packed on construction (a value that does not fit its packed type raises ValueError)."""

    task_id: int
    epoch: int
    episodes: Annotated[list[PackedEpisode], msgspec.Meta(max_length=4096)] = []
    error: Text = ""

    def __post_init__(self) -> None:
        self.episodes = pack_episodes(self.episodes)


class ResultAck(Msg, kw_only=True):
    """Reply to TaskResult: accepted | duplicate | stale_epoch | unknown_task | failed."""

    task_id: int
    status: str


MAX_RESULTS = 1024
"""Most task results one TaskResults message carries."""


class Outcome(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One task's result inside TaskResults: the fields of a TaskResult (episodes built in process
    are packed on construction)."""

    task_id: int
    epoch: int
    episodes: Annotated[list[PackedEpisode], msgspec.Meta(max_length=4096)] = []
    error: Text = ""

    def __post_init__(self) -> None:
        self.episodes = pack_episodes(self.episodes)


Index = Annotated[bytes, msgspec.Meta(max_length=MAX_PACKED_BYTES)]
"""int32 little-endian, one per sequence: an index into a table of SequenceColumns."""


class SequenceColumns(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every sequence of a TaskResults, one column per field, in order (result by result, episode
    by episode): a message's per-token arrays joined, one bytes object each, with each sequence's
    token count (protocol/columns.py builds, checks and slices them)."""

    lengths: Packed = b""
    """int32, one per sequence: its tokens."""
    tokens: Packed = b""
    """int32 token ids of every sequence, joined."""
    loss_mask: Packed = b""
    """uint8, joined."""
    logprobs: Packed = b""
    """float32, joined."""
    versions: Packed = b""
    """int32, joined."""
    rewards: Packed = b""
    """float64, one per sequence."""
    policy: Index = b""
    """Each sequence's policy, an index into `names`."""
    role: Index = b""
    """Each sequence's role, an index into `names`."""
    group_key: Index = b""
    """Each sequence's group key, an index into `keys`."""
    sampling: Index = b""
    """Each sequence's sampling settings, an index into `samplings`."""
    names: Annotated[list[Name], msgspec.Meta(max_length=4096)] = []
    """The distinct policy and role names of the message."""
    keys: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=1 << 20)
    ] = []
    """The distinct group keys of the message."""
    samplings: Annotated[list[SamplingParams], msgspec.Meta(max_length=4096)] = []
    """The distinct sampling settings of the message."""
    turns: Annotated[
        dict[int, Annotated[list[tuple[int, int, bool]], msgspec.Meta(max_length=65536)]],
        msgspec.Meta(max_length=1 << 20),
    ] = {}
    """Sequence index -> its recorded turns (only sequences that have them)."""


class ResultHead(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One task's result in a TaskResults, without its sequences (they are in the message's columns)."""

    task_id: int
    epoch: int
    episodes: Annotated[list[int], msgspec.Meta(max_length=4096)] = []
    """Sequences of each episode, in order."""
    infos: Annotated[
        dict[int, Annotated[dict[Name, Scalar], msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=4096)
    ] = {}
    """Episode index -> its info (only episodes that have one)."""
    error: Text = ""


class TaskResults(Msg, kw_only=True):
    """The results of several leased tasks, stored in one transaction (group commit): one head per
    result and one column per field for all their sequences (`TaskResults.of` builds it from Outcomes)."""

    results: Annotated[list[ResultHead], msgspec.Meta(max_length=MAX_RESULTS)]
    columns: SequenceColumns

    @classmethod
    def of(cls, outcomes: collections.abc.Sequence[Outcome], rid: int = 0) -> TaskResults:
        """These results in their columns (protocol/columns.py)."""
        from astraflow.protocol import columns

        return columns.pack(outcomes, rid)


class OutcomeAck(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What became of one result of a TaskResults: a ResultAck's status, or `invalid` with the
    code and message the single-result path answers as an Error."""

    task_id: int
    status: str
    code: str = ""
    message: str = ""


class ResultsAck(Msg, kw_only=True):
    """Reply to TaskResults: one OutcomeAck per result, in the order sent."""

    acks: list[OutcomeAck] = []


# ----- training ----------------------------------------------------------------------------------


class BatchRequest(Msg, kw_only=True):
    """A trainer asks for the batch of its policy's step `step` (1-based)."""

    policy: Name
    step: int
    wait_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """When the batch is not ready, the controller may hold the request up to this long (capped) and
    answer as soon as it is (a long poll)."""
    part: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Which part of the step's batch (a batch larger than one message comes in parts); a part
    after the first is served only for a recorded step."""


Chunks = Annotated[list[Packed], msgspec.Meta(max_length=1 << 20)]
"""One packed array per chunk of a SampleColumns."""


class SampleColumns(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A batch's samples (or one part's), one column per TrainSample field; the per-token arrays in
    chunks of consecutive samples (a stored group's, as the buffer kept them), each chunk one bytes
    object per field cut at the running sum of `lengths` (protocol/sample_columns.py builds, checks
    and cuts them)."""

    traj_ids: Packed = b""
    """int64 little-endian, one per sample."""
    lengths: Packed = b""
    """int32, one per sample: its tokens."""
    chunks: Packed = b""
    """int32, one per chunk: how many consecutive samples its arrays hold."""
    tokens: Chunks = []
    """Per chunk: the int32 token ids of its samples, joined."""
    loss_mask: Chunks = []
    """Per chunk: uint8, joined."""
    logprobs: Chunks = []
    """Per chunk: float32, joined."""
    versions: Chunks = []
    """Per chunk: int32, joined."""
    rewards: Packed = b""
    """float64, one per sample."""
    advantages: Packed = b""
    """float64, one per sample."""
    replay: Packed = b""
    """uint8 (0 or 1), one per sample."""
    sampling_runs: Packed = b""
    """int32, one per entry of `samplings`: how many consecutive samples have those settings."""
    samplings: Annotated[list[SamplingParams], msgspec.Meta(max_length=1 << 20)] = []
    """The sampling settings of each run of samples, in order."""

    @property
    def count(self) -> int:
        """Samples in these columns."""
        return len(self.traj_ids) // 8


class BatchReply(Msg, kw_only=True):
    """The recorded batch for a step (or one part of it), or not ready yet (retry), or done (budget reached)."""

    policy: str
    step: int
    columns: SampleColumns = SampleColumns()
    """The samples of this part of the batch, as columns."""
    ready: bool = False
    done: bool = False
    retry_after_s: float = 0.0
    part: int = 0
    """Which part of the batch `columns` is."""
    parts: int = 1
    """How many parts the batch has: the trainer asks for parts 1 .. parts-1 of the same step next."""

    @property
    def samples(self) -> list[TrainSample]:
        """The samples cut from the columns, in order (ValueError when the columns do not add up)."""
        from astraflow.protocol import sample_columns

        return sample_columns.cut(self.columns)


class VersionPublished(Msg, kw_only=True):
    """A trainer finished step `step`, producing `version`, now served at weights_addr."""

    policy: Name
    version: int
    step: int
    weights_addr: Annotated[str, msgspec.Meta(max_length=1024)]
    sha256: Annotated[str, msgspec.Meta(max_length=64)] = ""
    nbytes: int = 0
    metrics: Annotated[dict[Name, float], msgspec.Meta(max_length=1024)] = {}
    offers: Annotated[list[WeightOffer], msgspec.Meta(max_length=8)] = []
    """Faster paths for this version (VersionInfo.offers); the controller relays them unchanged."""


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

    policy: Name
    version: int
    chunk: int = -1
    kind: Annotated[str, msgspec.Meta(max_length=16)] = "full"
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
    """The blob's digest: sha256 over the sha256s of its 4 MiB leaves (weights/manifest.py)."""


class WeightChunk(Msg, kw_only=True):
    """The header of one chunk of a version's bytes: the bytes follow as the next frame of the same
    message, so both sides move them without encoding them (the receiver writes them in place)."""

    policy: str
    version: int
    index: int
    nbytes: int
    """Length of the data frame that follows."""


Message = (
    Hello
    | Welcome
    | Heartbeat
    | HeartbeatAck
    | Bye
    | Leave
    | Control
    | TaskRequest
    | TaskGrant
    | TaskResult
    | ResultAck
    | TaskResults
    | ResultsAck
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

"""Recipe models: the whole configuration of a run, validated with extra="forbid".

Over 400 lines because the whole recipe is one tree of models, read top to bottom, from which
docs/recipes.md's reference is generated.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.config.eval import EvalConfig
from astraflow.config.service import ServiceConfig
from astraflow.protocol.messages import MIN_TEMPERATURE


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""Run and policy names: they become directory and file names, so no '/', no '..', no leading '.'."""


class RunConfig(_Model):
    """What the run is called, how it is seeded and how long it lasts."""

    name: str = Field("run", pattern=NAME_PATTERN)
    """Run name (letters, digits, '.', '_', '-'); default run directories are runs/<name>-<time>/."""
    seed: int = 0
    """Seed of every random choice: prompts, sampling, initialisation."""
    steps: int = Field(100, ge=1)
    """Default step budget of every trainable policy (a policy's own `steps` overrides it)."""
    mode: Literal["async", "sync"] = "async"
    """async: every policy at its own pace within its staleness bound; sync: rollout, then train, in lock-step across policies (the baseline async is measured against)."""


class OptimizerConfig(_Model):
    """AdamW settings of one policy's trainer."""

    lr: float = Field(5e-6, gt=0)
    """Learning rate (constant)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables clipping."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up of the learning rate over this many steps."""


class SamplingOverridesConfig(_Model):
    """Per-call sampling overrides a result of this policy may claim beyond its task's own settings."""

    # The controller refuses a sequence whose settings are neither the task's (the recipe's, or
    # eval.sampling on an evaluation task) nor inside these bounds (dataflow/sampling_rule.py).

    temperature: tuple[float, float] = (MIN_TEMPERATURE, 2.0)
    """Lowest and highest temperature a call may switch to (the lowest at least 0.01)."""
    top_p: bool = True
    """Whether a call may switch top_p (any value in (0, 1])."""
    top_k: bool = False
    """Whether a call may switch top_k (any value >= 0)."""

    @model_validator(mode="after")
    def _check(self) -> SamplingOverridesConfig:
        lo, hi = self.temperature
        if not (MIN_TEMPERATURE <= lo <= hi) or not math.isfinite(hi):
            raise ValueError(f"temperature bounds must be finite with {MIN_TEMPERATURE} <= low <= high")
        return self


class SamplingConfig(_Model):
    """How the rollout engine samples for one policy."""

    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False)
    """Softmax temperature (at least 0.01); behaviour logprobs are those of the tempered distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = Field(0, ge=0, lt=1 << 31)
    """Keep only the k most likely tokens before top-p (0 = off)."""
    max_new_tokens: int = Field(64, ge=1)
    """Most tokens generated per call."""
    overrides: SamplingOverridesConfig = SamplingOverridesConfig()
    """Bounds on the per-call overrides of temperature, top_p and top_k that results may claim."""


class StageSpec(_Model):
    """One data-algorithm stage of a policy's pipeline (plugin group astraflow.data)."""

    name: str
    """Plugin name in astraflow.data."""
    options: dict[str, Any] = {}
    """Options validated by the stage's own Config model."""


class ModelInitConfig(_Model):
    """How `astraflow up` builds a policy's missing model directory (`astraflow model init`'s options)."""

    arch: str = "qwen3"
    """Architecture (qwen3)."""
    preset: str = "tiny"
    """Size preset (tiny, small, ...)."""
    seed: int = 0
    """Initialisation seed."""
    tokenizer: Literal["words", "bpe"] = "words"
    """words (the quickstart's digits) or bpe (byte-level, trained on `corpus`)."""
    corpus: str | None = None
    """UTF-8 text file the bpe tokenizer is trained on (relative to the working directory)."""
    vocab_size: int = Field(4096, ge=2)
    """Tokens of the bpe tokenizer."""

    def command(self, out: str) -> str:
        """The `astraflow model init` command that builds this model at out."""
        cmd = f"astraflow model init --arch {self.arch} --preset {self.preset} --seed {self.seed}"
        if self.tokenizer == "bpe":
            cmd += f" --tokenizer bpe --corpus {self.corpus} --vocab-size {self.vocab_size}"
        return f"{cmd} --out {out}"


class PolicyConfig(_Model):
    """One policy: its model, engine, trainer, objective, data pipeline and pace."""

    name: str = Field("main", pattern=NAME_PATTERN)
    """Policy name (letters, digits, '.', '_', '-'); workflows address policies through roles mapped to these names."""
    model: str
    """Path of a transformers model directory (config, weights, tokenizer) on every machine."""
    model_init: ModelInitConfig | None = None
    """How to make `model` when it is missing (random init, offline): `astraflow up` builds it; None: never."""
    trainable: bool = True
    """False: a frozen policy, served by RaaS at version 0 from `model`, with no trainer, no buffer and no budget."""
    steps: int | None = Field(None, ge=1)
    """This policy's step budget; None = run.steps."""
    engine: str = "torch"
    """Rollout engine plugin (astraflow.engines)."""
    engine_options: dict[str, Any] = {}
    """Options validated by the engine's Config model."""
    trainer: str = "torch"
    """Trainer plugin (astraflow.trainers)."""
    trainer_options: dict[str, Any] = {}
    """Options validated by the trainer's Config model."""
    loss: str = "grpo"
    """Objective plugin (astraflow.losses)."""
    loss_options: dict[str, Any] = {}
    """Options validated by the objective's Config model."""
    advantage: str = "grpo"
    """Advantage estimator (astraflow.advantages): grpo, drgrpo, rloo, reinforce_pp, gae; docs/losses.md."""
    advantage_options: dict[str, Any] = {}
    """Options validated by the advantage estimator's Config model."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer of this policy's trainer."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings of this policy's engine."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt; one task is one prompt and its whole group."""
    batch_prompts: int = Field(32, ge=1)
    """Prompts (groups) per optimizer step; batch size = batch_prompts * group_size sequences."""
    minibatches: int = Field(1, ge=1)
    """Optimizer updates per batch (the batch is split into this many minibatches)."""
    max_staleness: int = Field(1, ge=0)
    """Largest allowed (policy version at the step) - (oldest token version of a consumed sample)."""
    order: Literal["fifo", "edf"] = "edf"
    """Buffer order: edf serves the oldest token version first, fifo serves arrival order."""
    data: list[StageSpec] = []
    """Data-algorithm stages (before rollout, after rollout, buffer, batching) in this order."""
    checkpoint_every: int = Field(10, ge=1)
    """Save a trainer checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=0)
    """How many of the newest checkpoints the trainer keeps on disk (older ones are deleted once a newer one is complete); 0 keeps every one (for scoring each checkpoint afterwards)."""
    threads: int = Field(1, ge=1)
    """torch threads of this policy's trainer process."""
    trainer_sleep_s: float = Field(0.0, ge=0)
    """Benchmarking and testing knob: the trainer sleeps this long after every step, to model a policy whose steps cost more."""
    trainer_nproc: int = Field(1, ge=1)
    """Trainer ranks `astraflow up` starts for this policy (torchrun, FSDP2; one GPU each on CUDA)."""
    trainer_gpus: str = Field("", pattern=r"^(\d+(,\d+)*)?$")
    """GPUs of the trainer `astraflow up` starts for this policy, as CUDA_VISIBLE_DEVICES (e.g. "1"); empty = every GPU `up` sees."""
    max_seq_len: int | None = Field(None, ge=2)
    """Most tokens one sequence of this policy may carry (prompt and every turn); a result with a longer one is refused. None: the larger of the engine's `max_seq_len` option (the torch engine's default: 2048) and the model's max_position_embeddings."""
    max_abs_reward: float = Field(1e6, gt=0, le=1e30)
    """Largest absolute reward a result may claim for a sequence of this policy; a result with a larger one is refused (the cap keeps every sum and square of rewards finite)."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """The trainer stops with exit 1 after this many steps in a row skipped for a non-finite loss or gradient norm."""


class WorkflowConfig(_Model):
    """The agent workflow / environment that turns a prompt into episodes and rewards."""

    name: str = "quickstart"
    """Workflow plugin (astraflow.workflows)."""
    options: dict[str, Any] = {}
    """Options validated by the workflow's Config model."""
    roles: dict[str, str] = {}
    """Workflow role -> policy name; empty maps every role to the only policy."""
    after_budget: Literal["serve", "stop"] = "serve"
    """When a policy it feeds met its budget: serve keeps running tasks with that policy read-only (its sequences are not kept); stop queues no more tasks."""


class DatasetConfig(_Model):
    """Where prompts come from."""

    path: str = ""
    """A JSONL file of samples; empty means the workflow generates its own prompts."""
    size: int = Field(0, ge=0)
    """Number of generated prompts (0 = the workflow's default)."""


class AutoscaleConfig(_Model):
    """Sizing the RaaS pool with demand: workers added while tasks wait, drained while slots idle."""

    enabled: bool = False
    """Let the launcher add and drain RaaS workers; off: the pool keeps its starting size."""
    min: int = Field(1, ge=1)
    """Fewest RaaS workers the autoscaler keeps."""
    max: int = Field(4, ge=1)
    """Most RaaS workers the autoscaler starts (one key is made for each)."""
    up_queued: int = Field(1, ge=1)
    """A worker is added while at least this many queued tasks could be leased (a paused policy's are not counted) and up_busy_fraction holds."""
    up_busy_fraction: float = Field(0.9, gt=0, le=1)
    """A worker is added while at least this fraction of the alive workers' slots hold a lease (and up_queued holds)."""
    down_idle_fraction: float = Field(0.5, gt=0, le=1)
    """A worker is drained while at least this fraction of slots hold no lease, queued tasks or not (those wait on paused admission or newer weights, not on workers)."""
    window_s: float = Field(20.0, ge=0)
    """A condition must hold this long before the autoscaler acts on it."""
    cooldown_s: float = Field(30.0, ge=0)
    """Seconds after one change (a worker added, or one drained and gone) before the next."""
    interval_s: float = Field(2.0, gt=0)
    """How often the launcher reads the controller's demand."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"rollout.autoscale.min ({self.min}) is larger than max ({self.max})")
        return self


class RolloutConfig(_Model):
    """The rollout pool: RaaS processes `up` starts locally, their slots and leases."""

    local_workers: int = Field(2, ge=0)
    """RaaS processes `astraflow up` starts on this machine."""
    slots: int = Field(4, ge=1)
    """Concurrent tasks per RaaS (each task is one prompt's group)."""
    threads: int = Field(1, ge=1)
    """torch threads per RaaS process."""
    lease_timeout_s: float = Field(120.0, gt=0)
    """A lease its owner's heartbeats have not renewed for this long returns its task to the queue."""
    task_timeout_s: float = Field(900.0, gt=0)
    """A RaaS gives up a task whose episodes run longer than this and reports it failed (it is requeued)."""
    lease_max_age_s: float = Field(0.0, ge=0)
    """Heartbeats renew a lease only this long after it began (0: task_timeout_s + lease_timeout_s); it lapses within lease_timeout_s after that. A few times the expected episode time revokes hoarded leases sooner."""
    max_attempts: int = Field(5, ge=1)
    """A task that fails this many times is marked failed."""
    max_failed_tasks: int = Field(20, ge=0)
    """The run ends with exit 1 once this many tasks in a row failed every attempt (0: never)."""
    drain_timeout_s: float = Field(10.0, ge=0)
    """A leaving RaaS (SIGTERM, `astraflow leave`) waits this long for its running tasks, then returns the rest."""
    gpus: str = Field("", pattern=r"^(\d+(,\d+)*)?$")
    """GPUs of the RaaS processes `astraflow up` starts, as CUDA_VISIBLE_DEVICES (e.g. "0"); with several
    local workers and several GPUs, worker i gets the (i mod n)-th alone; empty = every GPU `up` sees."""
    autoscale: AutoscaleConfig = AutoscaleConfig()
    """Growing and shrinking the RaaS pool with demand (`up` and `launch ray`; `launch k8s` through an HPA)."""


class WeightsConfig(_Model):
    """How weights travel from trainers to RaaS workers."""

    mode: Literal["full", "delta"] = "full"
    """full: workers pull every version whole; delta: trainers also serve each version's lossless delta
    from the one before, and a worker patches the version it holds (full when new or too far behind).
    A trainer whose snapshots are on a GPU encodes deltas there: it keeps the previous version's
    snapshot in device memory (one more copy of the weights; up to three while an encode runs late)."""
    keep_versions: int = Field(4, ge=1)
    """Full versions a weight server keeps for pulling."""
    chunk_bytes: int = Field(4 << 20, ge=1024)
    """Chunk size of the weight data plane."""
    max_chain: int = Field(10, ge=1)
    """delta mode: a worker at most this many versions behind pulls the chain of deltas (when together
    smaller than the full version); further behind it pulls the full version. Also the most deltas a
    weight server keeps per policy."""
    relays: bool = False
    """Each RaaS serves the versions it pulled (and their deltas) on its own weight server, and the
    controller points a worker at a peer of its region that holds (or is fetching) a version, so a
    region costs the trainer one upload per version."""
    relay_wait_s: float = Field(10.0, ge=0)
    """How long a worker waits for a relay still fetching a version before pulling from the trainer."""
    delta_wait_s: float = Field(5.0, ge=0)
    """delta mode: how long a worker that holds the version before waits for a trainer still encoding
    the new version's delta (announced before its delta is ready) before pulling the full version."""
    pull_connections: int = Field(0, ge=0, le=8)
    """zmq: connections one pull spreads a version's chunks over (one per 16 MiB of it at most), each
    its own CURVE session on its own I/O thread on both sides, so encryption and hashing use several
    cores; a connection that drops hands its chunks to the others. 0: min(4, the worker's cores)."""
    transports: list[Literal["ipc", "broadcast", "zmq"]] = ["ipc", "zmq"]
    """Paths a version may take, fastest first as a worker tries them: ipc (same host: shared memory, or
    CUDA IPC of the trainer's GPU buffer), broadcast (torch.distributed groups, weights in the clear:
    opt in on trusted networks only, docs/protocol.md), zmq (the authenticated pull, the fallback:
    required)."""
    shared_slots: int = Field(2, ge=2, le=8)
    """ipc: packed buffers a trainer reuses in turn (2 = double buffering)."""
    bucket_bytes: int = Field(256 << 20, ge=1 << 16)
    """broadcast: bytes sent per collective call."""
    broadcast_timeout_s: float = Field(30.0, gt=0)
    """broadcast: a collective that takes longer fails; its group is dropped and its workers join again."""

    @model_validator(mode="after")
    def _zmq_fallback(self) -> WeightsConfig:
        if "zmq" not in self.transports:
            raise ValueError('weights.transports must include "zmq" (the fallback every worker can use)')
        return self


class RetentionConfig(_Model):
    """Which trajectories leave state.db during a run, so it stays small (state/archive.py)."""

    keep_steps: int | None = Field(None, ge=1)
    """Trajectories a policy consumed this many steps before its current one (and expired or dropped ones older than those) leave state.db, and so do the done tasks older than every trajectory kept (still counted); none (the default) keeps every trajectory there. With `drop` it must be at least every trainable policy's checkpoint_every, so a restarted trainer finds its recorded batches."""
    action: Literal["archive", "drop"] = "archive"
    """archive: move them to Parquet files in the run directory's archive/ (needs pyarrow: pip install 'astraflow[parquet]'), read by export, the dashboard's sample browser and resume; drop: delete them (status still counts them)."""
    every_steps: int = Field(10, ge=1)
    """Run a retention pass every this many steps of a policy."""
    archiver: Literal["inline", "process"] = "inline"
    """inline: the controller runs each pass itself; process: with `archive`, an archiver process reads the rows that leave and writes their file, and the controller only deletes them (state/archiver.py; a pass due while one runs is skipped, the next moves its rows). `drop` passes always run inline."""


class ControllerConfig(_Model):
    """The controller's socket and liveness settings."""

    bind: str = "tcp://127.0.0.1:0"
    """ROUTER endpoint; port 0 picks a free port (written to the run directory)."""
    heartbeat_interval_s: float = Field(0.5, gt=0)
    """Members send a heartbeat this often."""
    member_timeout_s: float = Field(5.0, gt=0)
    """A member silent for this long is dead; its leases return to the queue. A member that said it beats less often (an idle one) gets this times its interval over heartbeat_interval_s: the same number of missed beats."""
    idle_beats_per_s: float = Field(200.0, gt=0)
    """Most heartbeats per second the controller asks of its idle members together (no lease, no request it does not hold): with N live members an idle one beats every max(heartbeat_interval_s, N / this) s, at most 60 s. Fewer beats cost the controller less; an idle member's death is noticed that much later (it holds no lease)."""
    max_message_bytes: int = Field(64 << 20, ge=1024)
    """Largest accepted message; larger frames are dropped by the socket."""
    forget_after_s: float = Field(300.0, gt=0)
    """Dead or departed members are deleted from the state this long after they were last seen."""
    max_member_slots: int = Field(64, ge=1)
    """Most tasks one worker may hold at once, whatever slots it declares."""
    max_member_share: float = Field(0.5, gt=0, le=1)
    """While another healthy worker is alive, one worker may hold at most this share of the open tasks."""
    quarantine_after: int = Field(8, ge=1)
    """Failed attempts (errors, invalid results, lapsed leases) among a worker's last 32 before it may be quarantined."""
    quarantine_s: float = Field(600.0, gt=0)
    """How long a quarantined worker gets no leases (while a healthy peer is alive)."""
    synchronous: Literal["normal", "full"] = "normal"
    """state.db durability: normal survives the controller being killed; full also an OS crash (fsync per commit)."""
    stall_warn_s: float = Field(60.0, gt=0)
    """No policy made progress (no result, no step) for this long: log and show in status what each policy waits on."""
    stall_fail_s: float = Field(600.0, gt=0)
    """No progress for this long: the controller stops the run and `astraflow up` exits 1."""
    batch_part_bytes: int = Field(16 << 20, ge=1024, le=32 << 20)
    """Most bytes of samples in one BatchReply: a larger batch is sent in parts (at most half a member's 64 MiB message limit); a sequence larger than this is refused at ingest."""
    retention: RetentionConfig = RetentionConfig()
    """Trajectories that leave state.db during the run (off by default)."""


class SinkSpec(_Model):
    """One metric sink (plugin group astraflow.metric_sinks)."""

    name: str
    """Plugin name in astraflow.metric_sinks (built in: jsonl, sqlite, tensorboard)."""
    options: dict[str, Any] = {}
    """Options validated by the sink's own Config model."""


class MetricsConfig(_Model):
    """Where each step's metrics row goes besides metrics.jsonl (which is always written)."""

    sinks: list[SinkSpec] = []
    """Extra metric sinks, each receiving every metrics row (docs/metrics.md)."""


class Recipe(_Model):
    """A whole run."""

    run: RunConfig = RunConfig()
    """Name, seed and step budget."""
    policy: list[PolicyConfig]
    """One or more trained policies ([[policy]] tables)."""
    workflow: WorkflowConfig = WorkflowConfig()
    """The workflow/environment and its rewards."""
    dataset: DatasetConfig = DatasetConfig()
    """The prompt source."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout pool."""
    weights: WeightsConfig = WeightsConfig()
    """Weight transfer."""
    controller: ControllerConfig = ControllerConfig()
    """Controller socket and liveness."""
    metrics: MetricsConfig = MetricsConfig()
    """Metric sinks."""
    eval: EvalConfig | None = None
    """Held-out avg@k / pass@k evaluation during training (None: off; docs/recipes.md)."""
    service: list[ServiceConfig] = []
    """Helper processes `astraflow up` runs for the length of the run ([[service]] tables; docs/agents.md)."""

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        names = [p.name for p in self.policy]
        if not names:
            raise ValueError("a recipe needs at least one [[policy]]")
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique, got {names}")
        for role, pol in self.workflow.roles.items():
            if pol not in names:
                raise ValueError(f"workflow role {role!r} maps to unknown policy {pol!r}; policies: {names}")
        if not any(p.trainable for p in self.policy):
            raise ValueError("every policy has trainable = false: nothing to train")
        if self.eval is not None and any(p not in names for p in self.eval.policies):
            raise ValueError(f"eval.policies {self.eval.policies} names a policy not in {names}")
        services = [s.name for s in self.service]
        if len(set(services)) != len(services):
            raise ValueError(f"service names must be unique, got {services}")
        if self.controller.stall_fail_s < self.controller.stall_warn_s:
            raise ValueError("controller.stall_fail_s must be at least controller.stall_warn_s")
        keep = self.controller.retention
        if keep.keep_steps is not None and keep.action == "drop":
            short = [p.name for p in self.policy if p.trainable and p.checkpoint_every > keep.keep_steps]
            if short:
                raise ValueError(
                    f"controller.retention.keep_steps ({keep.keep_steps}) with drop must be at least the "
                    f"checkpoint_every of policies {short}: a restarted trainer asks again for its batches since"
                )
        return self

    def budget(self, name: str) -> int:
        """Step budget of policy `name` (its own steps, else run.steps; 0 for a frozen policy)."""
        p = self.get_policy(name)
        if not p.trainable:
            return 0
        return p.steps if p.steps is not None else self.run.steps

    def trainable(self) -> list[PolicyConfig]:
        """The policies that have a trainer."""
        return [p for p in self.policy if p.trainable]

    def get_policy(self, name: str) -> PolicyConfig:
        """The policy called `name`."""
        for p in self.policy:
            if p.name == name:
                return p
        raise KeyError(name)

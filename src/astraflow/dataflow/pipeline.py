"""Per-policy pipelines of data-algorithm stages, and the post-rollout path of a finished task.

The recipe lists each policy's stages (`policy.data`); their `kind` places them: curators decide
which prompts are submitted, filters keep or drop finished groups, the order stage ranks the
buffer and batch composers ask for replay. Stage state lives in the store's stage_state table and
is reloaded on restart; the pipeline's own counters are saved there too (stage index -1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from astraflow.config.recipe import PolicyConfig
from astraflow.data.base import (
    AdmissionStage,
    BatchComposer,
    BufferOrder,
    Curator,
    GroupFilter,
    GroupView,
    Stage,
)
from astraflow.data.turns import sequence_turns
from astraflow.dataflow.advantages import checked_advantages
from astraflow.dataflow.buffer import Buffer, default_order
from astraflow.dataflow.estimators import AdvantageEstimator, make_estimator
from astraflow.errors import RecipeError
from astraflow.log import get
from astraflow.protocol import sample_columns
from astraflow.protocol.messages import (
    AnyEpisodes,
    PackedEpisode,
    PackedSequence,
    SampleColumns,
    pack_episodes,
)
from astraflow.state.stage_rows import StageRows
from astraflow.state.store import Store

log = get("pipeline")

COUNTERS_STAGE = -1
"""stage_state index of the pipeline's own counters."""
INFO_TASKS = 4096
"""Tasks whose episode info is kept for step metrics (a batch draws from far fewer)."""
COUNTER_NAMES = ("prompts_submitted", "prompts_skipped", "groups_kept", "groups_dropped")


def _load_stage(name: str) -> type[Stage]:
    from astraflow import plugins

    return plugins.load("data", name)


@dataclass
class PolicyStages:
    """The instantiated stages of one policy, grouped by where they run."""

    name: str
    stages: list[Stage] = field(default_factory=list)
    curators: list[Curator] = field(default_factory=list)
    filters: list[GroupFilter] = field(default_factory=list)
    order: BufferOrder | None = None
    composers: list[BatchComposer] = field(default_factory=list)
    admissions: list[AdmissionStage] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0.0))
    estimator: AdvantageEstimator | None = None


@dataclass
class GroupOutcome:
    """What happened to one policy's group of a finished task."""

    policy: str
    traj_ids: list[int]
    rewards: list[float]
    kept: bool


class Pipeline:
    """Every policy's stages, called at the four points of the data path."""

    def __init__(
        self,
        policies: list[PolicyConfig],
        store: Store | None = None,
        *,
        seed: int,
        loader: Callable[[str], type[Stage]] = _load_stage,
    ) -> None:
        self.configs: dict[str, PolicyConfig] = {p.name: p for p in policies}
        """Each policy's recipe section, by name: its stages, advantage, order, batch and bounds."""
        self.seed = seed
        """The run's seed, handed to every stage."""
        self.store = store
        self.policies: dict[str, PolicyStages] = {}
        self.split_roles: set[str] = set()
        """Policies whose roles get separate groups (self-play with per-role baselines); set by the controller."""
        self.info: dict[tuple[str, int], dict[str, tuple[float, int]]] = {}
        """(policy, task id) -> info key -> (sum, count) of the task's episodes; the newest INFO_TASKS
        tasks are kept, so a step's metrics carry the info of the tasks its batch drew from."""
        self._loader = loader
        self._rows = StageRows(store) if store is not None else None
        """The stage_state rows as last written: a save that changes nothing writes nothing."""
        for pol in policies:
            self.policies[pol.name] = self._build(pol)
        self.load()
        if store is not None:
            store.on_rollback.append(self.reload)

    def _build(self, pol: PolicyConfig) -> PolicyStages:
        """Fresh stages of one policy, as the recipe lists them."""
        ps = PolicyStages(pol.name, estimator=make_estimator(pol.advantage, pol.advantage_options))
        for i, spec in enumerate(pol.data):
            cls = self._loader(spec.name)
            config_cls = getattr(cls, "Config", None)
            try:
                config = config_cls.model_validate(spec.options) if config_cls is not None else None
            except Exception as exc:
                raise RecipeError(
                    f"policy {pol.name!r} data stage {i} ({spec.name}): invalid options: {exc}",
                    hint="`astraflow recipe check` validates every stage's options",
                ) from None
            stage = cls(config, policy=pol.name, seed=self.seed)
            ps.stages.append(stage)
            if isinstance(stage, Curator):
                ps.curators.append(stage)
            elif isinstance(stage, GroupFilter):
                ps.filters.append(stage)
            elif isinstance(stage, BufferOrder):
                if ps.order is None:
                    ps.order = stage
            elif isinstance(stage, BatchComposer):
                ps.composers.append(stage)
            elif isinstance(stage, AdmissionStage):
                stage.bind(pol.max_staleness)
                ps.admissions.append(stage)
        if ps.order is None:
            ps.order = default_order(pol.order)
        return ps

    # ----- persistence --------------------------------------------------------------------------

    def load(self) -> None:
        """Restore every stage's state and the counters from the store."""
        if self.store is None:
            return
        for name, ps in self.policies.items():
            saved = self.store.load_stage_state(name)
            for i, stage in enumerate(ps.stages):
                if i in saved and saved[i][0] == type(stage).__name__:
                    stage.load_state_dict(saved[i][1])
            if COUNTERS_STAGE in saved:
                ps.counters.update({k: float(v) for k, v in saved[COUNTERS_STAGE][1].items()})

    def reload(self) -> None:
        """Rebuild every stage from the store: a transaction that rolled back (a handler that raised)
        takes the in-memory changes of its stages with it, so the next save cannot persist them."""
        for pol in self.configs.values():
            self.policies[pol.name] = self._build(pol)
        self.load()

    def save(self, policy: str | None = None) -> None:
        """Write every stage's state_dict (of one policy, or all) and the counters to the store
        (the rows whose state changed since this writer last wrote them)."""
        rows = self._rows
        if rows is None:
            return
        names = list(self.policies) if policy is None else [policy]
        states: list[tuple[str, int, str, dict[str, Any]]] = []
        for name in names:
            ps = self.policies[name]
            states.extend(
                (name, i, type(stage).__name__, stage.state_dict()) for i, stage in enumerate(ps.stages)
            )
            states.append((name, COUNTERS_STAGE, "pipeline", dict(ps.counters)))
        rows.save(states)

    # ----- before rollout -----------------------------------------------------------------------

    def group_room(self, policy: str, outstanding_groups: int) -> int:
        """Groups the policy's admission stages still allow (dataflow/admission.py asks; counts each answer)."""
        ps = self.policies.get(policy)
        room = 1 << 62
        if ps is None:
            return room
        batch = self.configs[policy].batch_prompts
        for st in ps.admissions:
            n = st.budget(outstanding_groups, batch)
            key = "admitted" if n > 0 else "held"
            if key in st.counts:  # stages that declare these counters get them filled here
                st.counts[key] += 1
            room = min(room, n)
        return room

    def max_staleness(self, policy: str) -> int:
        """The policy's staleness bound for admission: the tighter of its own and its admission stages'."""
        bound = self.configs[policy].max_staleness
        for st in self.policies[policy].admissions:
            bound = min(bound, st.max_staleness)
        return bound

    def submit(self, key: str, sample: dict[str, Any], policies: list[str]) -> bool:
        """Ask every curator of the task's policies; the prompt is submitted only if all agree."""
        ok = True
        for pol in policies:
            ps = self.policies.get(pol)
            if ps is None:
                continue
            # Every curator sees every offered prompt, so their bookkeeping does not depend on order.
            for cur in ps.curators:
                ok = cur.submit(key, sample) and ok
        for pol in policies:
            if pol in self.policies:
                self.policies[pol].counters["prompts_submitted" if ok else "prompts_skipped"] += 1
        return ok

    def on_version(self, policy: str, version: int) -> None:
        """Tell the policy's curators about a new version, then save its stages."""
        ps = self.policies.get(policy)
        if ps is None:
            return
        for cur in ps.curators:
            cur.on_version(version)
        self.save(policy)

    # ----- after rollout ------------------------------------------------------------------------

    def ingest(
        self,
        buffer: Buffer,
        task_id: int,
        prompt_key: str,
        episodes: AnyEpisodes,
        read_only: Iterable[str] = (),
    ) -> list[GroupOutcome]:
        """Store a finished task's sequences: group advantages, curator feedback, filters, buffer entry.

        Groups are (policy, group key): the sequence's group_key, with its role in front for a policy
        that plays several roles (self-play: one baseline per role) unless the workflow shares them.
        Sequences of read-only policies (frozen, or budget taken) are not kept; list episodes are packed."""
        episodes = pack_episodes(episodes)
        skip = set(read_only)
        groups: dict[tuple[str, str, str], list[tuple[PackedSequence, dict[str, Any]]]] = {}
        for ep in episodes:
            for seq in ep.sequences:
                if seq.policy not in self.policies:
                    log.warning("task %d: sequence of unknown policy %r ignored", task_id, seq.policy)
                    continue
                if seq.policy in skip:
                    continue
                role = seq.role if seq.policy in self.split_roles else ""
                groups.setdefault((seq.policy, role, seq.group_key), []).append((seq, ep.info))
        # every group's advantages first: a result with a non-finite one is refused before any state changes
        planned: list[tuple[str, list[tuple[PackedSequence, dict[str, Any]]], list[float], list[float]]] = []
        for (pol, _role, key), items in groups.items():
            rewards = [float(s.reward) for s, _ in items]
            estimator = self.policies[pol].estimator
            planned.append((pol, items, rewards, checked_advantages(estimator, pol, key, rewards)))
        for ep in episodes:
            self._observe_info(ep, skip, task_id)
        out: list[GroupOutcome] = []
        for pol, items, rewards, advantages in planned:
            ps = self.policies[pol]
            seqs = [s for s, _ in items]
            for cur in ps.curators:
                cur.observe(prompt_key, rewards)
            kept = True
            if ps.filters:  # only filters read the group's lengths and turns: without one none are derived
                view = self._view(task_id, prompt_key, pol, items, rewards, advantages)
                kept = all(f.keep(view) for f in ps.filters)
            ps.counters["groups_kept" if kept else "groups_dropped"] += 1
            ids = buffer.insert(
                task_id, prompt_key, seqs, advantages, status="buffered" if kept else "dropped"
            )
            out.append(GroupOutcome(pol, ids, rewards, kept))
        return out

    def _view(
        self,
        task_id: int,
        prompt_key: str,
        policy: str,
        items: list[tuple[PackedSequence, dict[str, Any]]],
        rewards: list[float],
        advantages: list[float],
    ) -> GroupView:
        """One group as the post-rollout filters see it: rewards, advantages, lengths, turns, info."""
        max_new = self.configs[policy].sampling.max_new_tokens
        turns = [sequence_turns(s, max_new) for s, _ in items]
        return GroupView(
            task_id=task_id,
            prompt_key=prompt_key,
            policy=policy,
            rewards=rewards,
            advantages=advantages,
            lengths=[sum(t.length for t in ts) for ts in turns],
            truncated=[any(t.truncated for t in ts) for ts in turns],
            info=[dict(info) for _, info in items],
            turn_lengths=[[t.length for t in ts] for ts in turns],
            turn_truncated=[[t.truncated for t in ts] for ts in turns],
        )

    def _observe_info(self, ep: PackedEpisode, skip: set[str], task_id: int) -> None:
        """Add an episode's numeric info to each (policy, role) it has sequences of."""
        if ep.info:  # else nothing to add (take_info reads a missing task as no info)
            ours = [s for s in ep.sequences if s.policy in self.policies and s.policy not in skip]
            self.observe_info(ep.info, {(s.policy, s.role) for s in ours}, task_id)

    def observe_info(self, info: dict[str, Any], seen: set[tuple[str, str]], task_id: int) -> None:
        """Add an episode's numeric info to each (policy, role) of `seen` (its kept sequences')."""
        nums = {k: float(v) for k, v in info.items() if isinstance(v, float | int) and type(v) is not bool}
        for pol in {p for p, _ in seen}:
            acc = self.info.setdefault((pol, task_id), {})
            while len(self.info) > INFO_TASKS:
                del self.info[next(iter(self.info))]
            pairs = [(f"info/{k}", v) for k, v in nums.items()]
            for role in sorted({r for p, r in seen if p == pol and r}):
                pairs += [(f"info/{role}/{k}", v) for k, v in nums.items()]
            for key, v in pairs:
                total, n = acc.get(key, (0.0, 0))
                acc[key] = (total + v, n + 1)

    def take_info(self, policy: str, task_ids: Iterable[int]) -> dict[str, float]:
        """Means of the policy's episode info over these tasks (those a batch drew from). Scoped to
        the batch, not to the results since the last step: results come in bursts, so two steps may
        see no new result between them yet both train on sequences that carry info."""
        acc: dict[str, tuple[float, int]] = {}
        for tid in dict.fromkeys(task_ids):
            for k, (total, n) in self.info.get((policy, tid), {}).items():
                t0, n0 = acc.get(k, (0.0, 0))
                acc[k] = (t0 + total, n0 + n)
        return {k: total / n for k, (total, n) in acc.items() if n}

    # ----- buffer and batching ------------------------------------------------------------------

    def order(self, policy: str) -> BufferOrder:
        """The policy's buffer order (its order stage, else the recipe's policy.order)."""
        order = self.policies[policy].order
        assert order is not None
        return order

    def replay_count(self, policy: str, batch_size: int) -> int:
        """Sequences of a batch to replay: the composers' requests, summed and capped at the batch size,
        then lowered so that the fresh part is whole groups (64 with replay 0.3 and groups of 8: 19
        asked, 16 replayed, 48 fresh). A fresh part that splits groups leaves a group's rest to the next
        step, where it can pass the staleness bound; replay never exceeds what the composers asked."""
        n = max(
            0, min(sum(int(c.replay_count(batch_size)) for c in self.policies[policy].composers), batch_size)
        )
        group = self.configs[policy].group_size
        if n and group > 1:
            fresh = min(batch_size, -(-(batch_size - n) // group) * group)
            n = batch_size - fresh
        return n

    def batch_level(self, policy: str) -> bool:
        """Whether the policy's estimator changes advantages per served batch."""
        est = self.policies[policy].estimator
        return est is not None and est.batch_level

    def batch_columns(
        self, policy: str, cols: SampleColumns, whole: list[float] | None = None, start: int = 0
    ) -> SampleColumns:
        """Served columns with the estimator's batch stage applied to their advantages (unchanged for
        group-only estimators). `whole`: the stored advantages of the whole batch when `cols` is its
        part from `start`."""
        est = self.policies[policy].estimator
        n = cols.count
        if est is None or not est.batch_level or not n:
            return cols
        advs = est.batch(whole if whole is not None else sample_columns.advantage_list(cols))
        return sample_columns.with_advantages(cols, advs[start : start + n])

    def on_batch(self, policy: str, replayed: int) -> None:
        """Tell the composers how many sequences a newly recorded batch replayed."""
        for c in self.policies[policy].composers:
            c.on_batch(replayed)

    def fresh_per_batch(self, policy: str, batch_size: int) -> int:
        """Fresh sequences one batch consumes: the batch minus what the composers replay."""
        return max(1, batch_size - self.replay_count(policy, batch_size))

    def metrics(self, policy: str) -> dict[str, float]:
        """The pipeline's counters and every stage's metrics, as `data/<stage>/<name>` keys."""
        ps = self.policies[policy]
        out: dict[str, float] = {f"data/{k}": float(v) for k, v in ps.counters.items()}
        for i, stage in enumerate(ps.stages):
            label = self.configs[policy].data[i].name
            for k, v in stage.metrics().items():
                out[f"data/{label}/{k}"] = float(v)
        return out

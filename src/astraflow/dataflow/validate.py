"""Check a task's result against the task before anything of it is recorded.

A worker's result is data from the network: it may be buggy or forged. Everything a trainer
relies on is checked here: each policy has the sequences the task asks of it (the workflow's shape
of the task's per-policy group sizes; at most that many for a policy read-only in the task), every
sequence belongs to a policy the workflow's roles map to, token ids are inside the policy's vocabulary, the per-token
arrays have one entry per token, versions exist, logprobs are finite and at most 0, rewards are
finite, sampling settings are those the task allowed (dataflow/sampling_rule.py), each sequence keeps
to the bounds of dataflow/limits.py (length, |reward|, lowest logprob, bytes) and episode info numbers
are finite. A result that fails is a failed attempt with the reason (docs/protocol.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Any

import numpy as np

from astraflow import log
from astraflow.config.recipe import Recipe
from astraflow.data.turns import turns_problem
from astraflow.dataflow.limits import MIN_LOGPROB, Limits, info_problem, infos_problem
from astraflow.dataflow.sampling_rule import sampling_problem
from astraflow.protocol import packed
from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import AnyEpisodes, PackedSequence, SamplingParams, Sequence, pack_episodes

_log = log.get("validate")

_BINARY = frozenset((0, 1))

MAX_SEQUENCES_PER_EPISODE = 256
"""Most sequences one episode may carry (a multi-turn, multi-agent episode stays far below)."""


def vocab_size(model_dir: str) -> int | None:
    """The vocabulary size in a transformers model directory's config.json (None if unreadable)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    return int(v) if isinstance(v, int) and v > 0 else None


@dataclass
class ResultChecker:
    """Knows each policy's vocabulary size; `check` says what is wrong with a result ('' when nothing)."""

    recipe: Recipe
    vocab: dict[str, int | None] = field(default_factory=dict)
    limits: Limits | None = None
    """Length, reward, logprob and size bounds per policy (dataflow/limits.py); None: from the recipe."""

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = Limits.of(self.recipe)
        for p in self.recipe.policy:
            if p.name not in self.vocab:
                self.vocab[p.name] = vocab_size(p.model)
                if self.vocab[p.name] is None:
                    _log.warning(
                        "policy %r: no vocab_size in %s/config.json here; token ids are checked for >= 0 only",
                        p.name,
                        p.model,
                    )

    def check(
        self,
        episodes: AnyEpisodes,
        *,
        expected: dict[str, int],
        roles: dict[str, str],
        latest: dict[str, int],
        task_sampling: dict[str, float | int] | None = None,
        cleared: bool = False,
    ) -> str:
        """Why the result is invalid ('' when it is fine). `cleared`: its sequences already passed
        `clear_columns` (with the other results of its message), so only the checks of the result's
        shape are left. `expected`: sequences the task asks of each
        policy at most (workflows shape episodes per policy, so the episode count alone says nothing;
        admission counts with it, so more would overrun the staleness cap); fewer is fine, none
        included (a workflow may skip a role on some tasks, or generate less with a read-only
        policy: its groups are then smaller and admission queues more); `latest` is each policy's
        newest version; `task_sampling` the task's sampling overrides (Task.sampling). Episodes of
        Python lists (in-process callers) are packed first, as a RaaS sends them."""
        allowed = set(roles.values())
        why = episodes_problem([len(ep.sequences) for ep in episodes])
        if why:
            return why
        # the whole result's sequences are checked at once first; only a result that fails is walked
        # sequence by sequence, to name the first sequence at fault and why
        clean = cleared
        try:
            seqs = [] if cleared else [s for ep in pack_episodes(episodes) for s in ep.sequences]
        except ValueError:  # in-process lists with a value no packed type holds: the walk names it
            seqs = []
        if seqs:
            try:
                clean = self._clean(seqs, allowed, latest, task_sampling or {})
            except (TypeError, ValueError):  # a value of the wrong type (in-process callers): walk them
                clean = False
        for i, ep in enumerate(episodes if not clean else ()):
            walked: list[Sequence | PackedSequence] = list(ep.sequences)
            for j, s in enumerate(walked):
                why = self._walk(s, allowed, latest, task_sampling or {})
                if why:
                    return f"episode {i} sequence {j}: {why}"
        got: dict[str, int] = {}
        for ep in episodes:
            for s in ep.sequences:
                got[s.policy] = got.get(s.policy, 0) + 1
        return info_problem(episodes) or _overrun(got, len(episodes), allowed, expected)

    def check_cleared(
        self,
        counts: list[int],
        infos: dict[int, dict[str, Any]],
        got: dict[str, int],
        *,
        expected: dict[str, int],
        roles: dict[str, str],
    ) -> str:
        """`check` of a result whose sequences `clear_columns` cleared, read from its columns: its
        episodes' sequence counts, the infos of those that have one, and its sequences per policy."""
        why = episodes_problem(counts)
        if why:
            return why
        return infos_problem((i, infos[i]) for i in sorted(infos)) or _overrun(
            got, len(counts), set(roles.values()), expected
        )

    def _walk(
        self,
        s: Sequence | PackedSequence,
        allowed: set[str],
        latest: dict[str, int],
        task_sampling: dict[str, float | int],
    ) -> str:
        """What is wrong with one sequence ('' when nothing), read as lists: slow, only for a result
        the whole-result pass did not clear."""
        if isinstance(s, PackedSequence):
            if s.policy not in allowed:
                return f"policy {s.policy!r} is not one the task's roles map to ({sorted(allowed)})"
            why = packed.layout_problem(s.tokens, s.loss_mask, s.logprobs, s.versions)
            if why:
                return why
            s = s.unpack()
        why = self._sequence(s, allowed, latest, task_sampling)
        if not why and self.limits is not None:
            why = self.limits.sequence(s)
        return why

    def _clean(
        self,
        seqs: list[PackedSequence],
        allowed: set[str],
        latest: dict[str, int],
        task_sampling: dict[str, float | int],
    ) -> bool:
        """Whether every sequence passes every check of `_walk`, decided with a few numpy reductions
        over the result's packed arrays (per policy) instead of a dozen calls per sequence.
        False means "walk them one by one", never "invalid" by itself."""
        by_policy: dict[str, list[PackedSequence]] = {}
        for s in seqs:
            by_policy.setdefault(s.policy, []).append(s)
        if not allowed.issuperset(by_policy):
            return False
        for policy, group in by_policy.items():
            sizes = [len(s.loss_mask) for s in group]
            # equal int32 sizes (4 bytes a token) make every size a whole number of items
            quads = [4 * n for n in sizes]
            if (
                min(sizes) == 0
                or quads != [len(s.tokens) for s in group]
                or quads != [len(s.logprobs) for s in group]
                or quads != [len(s.versions) for s in group]
            ):
                return False
            arrays = (
                np.frombuffer(b"".join([s.tokens for s in group]), packed.INT32),
                np.frombuffer(b"".join([s.loss_mask for s in group]), np.uint8),
                np.frombuffer(b"".join([s.logprobs for s in group]), packed.FLOAT32),
                np.frombuffer(b"".join([s.versions for s in group]), packed.INT32),
            )
            rewards = [s.reward for s in group]
            turned = [s for s in group if s.turns is not None]
            claimed = {s.sampling for s in group}
            if not self._clean_policy(
                policy, max(sizes), arrays, rewards, turned, claimed, latest, task_sampling
            ):
                return False
        return True

    def clear_columns(
        self,
        view: ResultColumns,
        results: list[tuple[int, dict[str, str], dict[str, float | int]]],
        latest: dict[str, int],
    ) -> list[bool]:
        """Which of these results of a message, read from its columns ((result index, roles, task
        sampling overrides) each), pass `_clean`: the sequences of every result with the same roles
        and overrides in one pass over the columns (no Python object per sequence), so a group
        commit costs a few numpy reductions per message, not per result. A result not cleared is
        checked alone by `check` (which names its fault), never refused for this."""
        out = [False] * len(results)
        together: dict[tuple[Any, ...], list[int]] = {}
        for k, (_i, roles, sampling) in enumerate(results):
            key = (tuple(sorted(set(roles.values()))), tuple(sorted(sampling.items())) if sampling else ())
            together.setdefault(key, []).append(k)
        for key, ks in together.items():
            sel = np.zeros(view.count, np.bool_)
            for k in ks:
                a, b = view.span(results[k][0])
                sel[a:b] = True
            clean = bool(sel.any()) and self._clean_columns(view, sel, set(key[0]), latest, dict(key[1]))
            for k in ks:
                out[k] = clean
        return out

    def _clean_columns(
        self,
        view: ResultColumns,
        sel: np.ndarray[Any, Any],
        allowed: set[str],
        latest: dict[str, int],
        task_sampling: dict[str, float | int],
    ) -> bool:
        """`_clean` of the selected sequences of a message's columns."""
        names = view.cols.names
        by_policy: dict[str, list[int]] = {}
        for idx in _distinct(view.policy[sel]):
            by_policy.setdefault(names[idx], []).append(idx)
        if not allowed.issuperset(by_policy):
            return False
        c = view.cols
        whole = (
            np.frombuffer(c.tokens, packed.INT32),
            np.frombuffer(c.loss_mask, np.uint8),
            np.frombuffer(c.logprobs, packed.FLOAT32),
            np.frombuffer(c.versions, packed.INT32),
        )
        for policy, idxs in by_policy.items():
            pick = sel if len(by_policy) == 1 else sel & np.isin(view.policy, idxs)
            sizes = view.lengths[pick]
            if int(sizes.min()) == 0:
                return False
            if pick.all():
                arrays = whole
            else:
                per_token = np.repeat(pick, view.lengths)
                arrays = (whole[0][per_token], whole[1][per_token], whole[2][per_token], whole[3][per_token])
            rewards = view.rewards[pick].tolist()
            turned = [view.sequence(k) for k in c.turns if pick[k]]
            claimed = {c.samplings[i] for i in _distinct(view.sampling[pick])}
            if not self._clean_policy(
                policy, int(sizes.max()), arrays, rewards, turned, claimed, latest, task_sampling
            ):
                return False
        return True

    def _clean_policy(
        self,
        policy: str,
        longest: int,
        arrays: tuple[np.ndarray[Any, Any], ...],
        rewards: list[float],
        turned: list[PackedSequence],
        claimed: set[SamplingParams],
        latest: dict[str, int],
        task_sampling: dict[str, float | int],
    ) -> bool:
        """Whether one policy's sequences, whose joined (tokens, mask, logprobs, versions) are
        `arrays`, pass every check of `_walk` (sizes agree: the caller checked)."""
        tokens, mask, logprobs, versions = arrays
        vocab = self.vocab.get(policy)
        if tokens.min() < 0 or (vocab is not None and tokens.max() >= vocab):
            return False
        if mask.max() > 1:
            return False
        # a NaN makes max and min NaN, and every comparison with NaN is False
        if not (logprobs.max() <= 0.0 and logprobs.min() >= MIN_LOGPROB):
            return False
        low = int(versions.min())
        if int(versions.max()) > latest.get(policy, 0) or low < -1:
            return False
        if low < 0 and versions[mask.astype(np.bool_)].min(initial=0) < 0:
            return False
        if not all(map(math.isfinite, rewards)):
            return False
        # recorded turns (multi-turn transcripts) against the mask bytes, once the sizes agree
        if any(turns_problem(s) for s in turned):
            return False
        if self.limits is not None and not self.limits.group_fits(policy, longest, rewards):
            return False
        recipe_sampling = self.recipe.get_policy(policy).sampling
        return not any(sampling_problem(s, recipe_sampling, task_sampling) for s in claimed)

    def _sequence(
        self, s: Sequence, allowed: set[str], latest: dict[str, int], task_sampling: dict[str, float | int]
    ) -> str:
        if s.policy not in allowed:
            return f"policy {s.policy!r} is not one the task's roles map to ({sorted(allowed)})"
        n = len(s.tokens)
        if n == 0:
            return "no tokens"
        if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n):
            return (
                f"tokens/loss_mask/logprobs/versions lengths differ "
                f"({n}/{len(s.loss_mask)}/{len(s.logprobs)}/{len(s.versions)})"
            )
        vocab = self.vocab.get(s.policy)
        lo, hi = min(s.tokens), max(s.tokens)
        if lo < 0 or (vocab is not None and hi >= vocab):
            return f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab})"
        # whole-list checks run in C (set, map, min/max, compress); a Python loop per token would
        # cost more than everything else the controller does with a sequence of a thousand tokens
        if not _BINARY.issuperset(s.loss_mask):
            return "loss_mask holds values other than 0 and 1"
        if not all(map(math.isfinite, s.logprobs)) or max(s.logprobs) > 0.0:
            return "logprobs must be finite and <= 0"
        newest = latest.get(s.policy, 0)
        if (
            max(s.versions) > newest
            or min(s.versions) < -1
            or min(compress(s.versions, s.loss_mask), default=0) < 0
        ):
            for v, mk in zip(s.versions, s.loss_mask, strict=True):
                if v > newest or v < (0 if mk else -1):
                    return f"version {v} does not exist (newest {newest}; -1 only where loss_mask is 0)"
        if not math.isfinite(s.reward):
            return "reward is not finite"
        why = sampling_problem(s.sampling, self.recipe.get_policy(s.policy).sampling, task_sampling)
        if why:
            return f"sampling settings not allowed by the task: {why}"
        return turns_problem(s)


def _distinct(a: np.ndarray[Any, Any]) -> list[int]:
    """The distinct values of an int array (one comparison when they are all the same, the usual case)."""
    if not len(a) or bool((a == a[0]).all()):
        return a[:1].tolist()
    return np.unique(a).tolist()


def episodes_problem(counts: list[int]) -> str:
    """Why a result's episodes, by their sequence counts, are not a result's ('' when they are)."""
    if not counts:
        return "0 episodes"
    for i, n in enumerate(counts):
        if not n:
            return f"episode {i} has no sequence"
        if n > MAX_SEQUENCES_PER_EPISODE:
            return f"episode {i} has {n} sequences (at most {MAX_SEQUENCES_PER_EPISODE})"
    return ""


def _overrun(got: dict[str, int], episodes: int, allowed: set[str], expected: dict[str, int]) -> str:
    """Which policy has more sequences (`got`, per policy) than the task asks of it ('' when none)."""
    for pol in sorted(allowed):
        n, want = got.get(pol, 0), expected.get(pol, 0)
        if n > want:
            return (
                f"{n} sequences of policy {pol!r} in {episodes} episodes, the task asks for at "
                f"most {want} (the workflow's sequences_per_task must count every sequence it returns)"
            )
    return ""

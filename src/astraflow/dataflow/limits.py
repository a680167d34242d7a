"""What one sequence of a result may claim: its length, its reward, its per-token values, its bytes.

These bounds keep every number the controller derives from a result finite (group means and squares
of rewards, advantages) and every batch deliverable (a sequence fits one batch part, so any batch can
be streamed to its trainer in parts: dataflow/batch_parts.py). `dataflow/validate.py` applies them to
each sequence before anything of a result is stored (docs/protocol.md "What a result may claim").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.config.recipe import PolicyConfig, Recipe
from astraflow.protocol.messages import AnyEpisodes, Sequence

MIN_LOGPROB = -1000.0
"""Lowest behaviour logprob a generated token may carry: a token that unlikely is never sampled (in
float32 no probability is below e^-104, in float64 below e^-745); 0.0 on masked tokens."""
SAMPLE_OVERHEAD_BYTES = 256
"""Bytes of a TrainSample's encoding besides its four per-token arrays (field names, scalars)."""


def seq_bytes(n_tokens: int) -> int:
    """An upper bound of the encoded size of a TrainSample of n tokens: packed arrays of 4 + 1 + 4 + 4
    bytes a token, each with at most 5 bytes of msgpack header (computed without encoding anything)."""
    return SAMPLE_OVERHEAD_BYTES + n_tokens * (4 + 1 + 4 + 4) + 4 * 5


def samples_bytes(tokens: int, samples: int) -> int:
    """`seq_bytes` summed over `samples` TrainSamples of `tokens` tokens in all (it is linear)."""
    return samples * (SAMPLE_OVERHEAD_BYTES + 4 * 5) + tokens * (4 + 1 + 4 + 4)


def model_max_positions(model_dir: str) -> int | None:
    """max_position_embeddings of a transformers model directory's config.json (None if unreadable)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return int(v) if isinstance(v, int) and v > 0 else None


def policy_max_seq_len(p: PolicyConfig) -> int | None:
    """The longest sequence policy `p` may carry: its own max_seq_len, else the larger of its engine's
    max_seq_len option (read through the engine's options model, without importing the engine) and the
    model's max_position_embeddings; None when neither is known. The larger, because a multi-turn
    transcript may end with masked tokens (a tool's output) past what the engine generated in."""
    if p.max_seq_len is not None:
        return p.max_seq_len
    from astraflow import plugins
    from astraflow.errors import PluginError

    known: list[int] = []
    try:
        options = plugins.options_model("engines", p.engine)
    except PluginError:
        options = None
    if options is not None:
        try:
            value = getattr(options.model_validate(p.engine_options), "max_seq_len", None)
        except ValueError:
            value = None
        if isinstance(value, int) and value > 0:
            known.append(value)
    positions = model_max_positions(p.model)
    if positions is not None:
        known.append(positions)
    return max(known) if known else None


class RefusedResult(ValueError):
    """A result with a value that cannot be stored (a non-finite advantage); nothing of it is kept."""


def nonfinite_row(reward: float, advantage: float) -> str:
    """Which float of a trajectory row is not finite ('' when none): SQLite would store NaN as NULL
    (the sampling settings' floats are checked finite by dataflow/validate.py)."""
    for name, v in (("reward", reward), ("advantage", advantage)):
        if not math.isfinite(v):
            return f"{name} {v!r}"
    return ""


@dataclass
class Limits:
    """The bounds of one run, per policy; `sequence` says what a sequence breaks ('' when nothing)."""

    max_seq_len: dict[str, int | None]
    max_abs_reward: dict[str, float]
    part_bytes: int
    """Most bytes of samples in one BatchReply (controller.batch_part_bytes)."""

    @classmethod
    def of(cls, recipe: Recipe) -> Limits:
        """The limits a recipe sets."""
        return cls(
            max_seq_len={p.name: policy_max_seq_len(p) for p in recipe.policy},
            max_abs_reward={p.name: p.max_abs_reward for p in recipe.policy},
            part_bytes=recipe.controller.batch_part_bytes,
        )

    def sequence(self, s: Sequence) -> str:
        """Why sequence `s` claims more than its policy allows ('' when it does not)."""
        n = len(s.tokens)
        most = self.max_seq_len.get(s.policy)
        if most is not None and n > most:
            return (
                f"{n} tokens, longer than the max_seq_len of policy {s.policy!r} ({most}; raise "
                "policy.max_seq_len or the engine's max_seq_len option if the workflow means it)"
            )
        if seq_bytes(n) > self.part_bytes:
            return (
                f"{n} tokens take up to {seq_bytes(n)} bytes, more than one batch part can carry "
                f"(controller.batch_part_bytes = {self.part_bytes})"
            )
        bound = self.max_abs_reward.get(s.policy, 0.0)
        if not (math.isfinite(s.reward) and abs(s.reward) <= bound):
            return f"reward {s.reward!r} is not finite or beyond the max_abs_reward of policy {s.policy!r} ({bound:g})"
        lo = min(s.logprobs, default=0.0)
        if math.isfinite(lo) and lo < MIN_LOGPROB:
            return f"logprob {lo!r} below {MIN_LOGPROB:g}: no sampled token is that unlikely"
        return ""

    def group_fits(self, policy: str, longest: int, rewards: list[float]) -> bool:
        """Whether sequences of `policy` of at most `longest` tokens with these (finite) rewards keep to
        the length, size and reward bounds `sequence` checks (the logprob floor is the caller's)."""
        most = self.max_seq_len.get(policy)
        if (most is not None and longest > most) or seq_bytes(longest) > self.part_bytes:
            return False
        bound = self.max_abs_reward.get(policy, 0.0)
        return max(map(abs, rewards)) <= bound


def info_problem(episodes: AnyEpisodes) -> str:
    """Why an episode's info is unusable ('' when it is fine): its numbers feed step metrics."""
    return infos_problem(enumerate(ep.info for ep in episodes))


def infos_problem(infos: Iterable[tuple[int, Mapping[str, Any]]]) -> str:
    """info_problem of (episode index, info) pairs, in order."""
    for i, info in infos:
        for k, v in info.items():
            if isinstance(v, float) and not math.isfinite(v):
                return f"episode {i} info {k!r} is {v!r} (numbers must be finite)"
    return ""

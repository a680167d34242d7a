"""GRESO (arXiv 2506.02177): skip prompts whose recent groups had zero reward variance.

A prompt whose last `z` groups all had equal rewards (all solved: easy; all failed: hard) is likely
to give another zero-advantage group, so it is submitted only with probability
`max(p_kind ** z, floor_kind)`. Each policy version nudges `p_easy` and `p_hard` so that the share of
zero-variance groups of each kind tracks its target: too many zero-variance groups means explore less.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field, model_validator

from astraflow.data.base import Curator, StageConfig, zero_variance

Kind = Literal["easy", "hard"]


class GresoConfig(StageConfig):
    """Options of the GRESO curator."""

    p_init: float = Field(0.5, ge=0.01, le=0.99)
    """Starting base exploration probability of both kinds."""
    step: float = Field(0.01, gt=0, le=0.5)
    """How far p_easy / p_hard move per policy version."""
    p_min: float = Field(0.01, gt=0, lt=1)
    """Lowest base exploration probability."""
    p_max: float = Field(0.99, gt=0, le=1)
    """Highest base exploration probability."""
    target_easy: float = Field(0.083, ge=0, le=1)
    """Target share of observed groups that are easy (all-solved) zero-variance groups."""
    target_hard: float = Field(0.167, ge=0, le=1)
    """Target share of observed groups that are hard (all-failed) zero-variance groups."""
    floor_easy: float = Field(0.05, ge=0, le=1)
    """Submission probability never drops below this for an easy streak."""
    floor_hard: float = Field(0.30, ge=0, le=1)
    """Submission probability never drops below this for a hard streak."""
    easy_above: float = Field(0.5)
    """A zero-variance group is easy when its mean reward is above this, else hard."""
    warmup_groups: int | None = Field(None, ge=0)
    """Groups to observe before skipping starts; None = one epoch (until a prompt is offered twice)."""
    tol: float = Field(1e-9, ge=0)
    """Rewards closer than this count as equal."""

    @model_validator(mode="after")
    def _check(self) -> GresoConfig:
        if not self.p_min <= self.p_init <= self.p_max:
            raise ValueError(f"need p_min <= p_init <= p_max, got {self.p_min}, {self.p_init}, {self.p_max}")
        return self


class GresoCurator(Curator):
    """Probabilistically skips prompts with a streak of zero-variance groups."""

    Config = GresoConfig
    config: GresoConfig

    def __init__(self, config: GresoConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        cfg = self.config
        # String seeds are hashed with sha512, so the stream is stable across processes.
        self.rng = random.Random(f"greso:{seed}:{policy}")
        self.p: dict[str, float] = {"easy": cfg.p_init, "hard": cfg.p_init}
        self.streaks: dict[str, tuple[int, Kind]] = {}
        """prompt key -> (consecutive zero-variance groups, kind of the latest one)."""
        self.window: dict[str, int] = {"groups": 0, "easy": 0, "hard": 0}
        """Groups observed since the last version, and how many were zero-variance of each kind."""
        self.warm = cfg.warmup_groups == 0
        self.offered: set[str] = set()
        self.observed = 0
        self.counts: dict[str, int] = {"submitted": 0, "skipped": 0, "skipped_easy": 0, "skipped_hard": 0}

    def probability(self, key: str) -> float:
        """Probability that `key` is submitted now (1.0 for streak 0 or during warm-up)."""
        z, kind = self.streaks.get(key, (0, "hard"))
        if z == 0 or not self.warm:
            return 1.0
        floor = self.config.floor_easy if kind == "easy" else self.config.floor_hard
        return max(self.p[kind] ** z, floor)

    def submit(self, key: str, sample: dict[str, Any]) -> bool:
        """Submit unless the prompt's zero-variance streak says it is probably not worth it."""
        if not self.warm and self.config.warmup_groups is None:
            if key in self.offered:
                self._end_warmup()
            else:
                self.offered.add(key)
        z, kind = self.streaks.get(key, (0, "hard"))
        # Streak 0 draws nothing, so the random stream depends only on the skip decisions made.
        if z == 0 or not self.warm or self.rng.random() < self.probability(key):
            self.counts["submitted"] += 1
            return True
        self.counts["skipped"] += 1
        self.counts[f"skipped_{kind}"] += 1
        return False

    def observe(self, key: str, rewards: list[float]) -> None:
        """Extend or reset the prompt's streak and count the group in this version's window."""
        self.observed += 1
        self.window["groups"] += 1
        if not zero_variance(rewards, self.config.tol):
            self.streaks.pop(key, None)
        else:
            mean = sum(rewards) / len(rewards) if rewards else 0.0
            kind: Kind = "easy" if mean > self.config.easy_above else "hard"
            z, last = self.streaks.get(key, (0, kind))
            # A flip between all-solved and all-failed is itself informative: restart the streak.
            self.streaks[key] = (z + 1 if last == kind else 1, kind)
            self.window[kind] += 1
        if (
            not self.warm
            and self.config.warmup_groups is not None
            and self.observed >= self.config.warmup_groups
        ):
            self._end_warmup()

    def on_version(self, version: int) -> None:
        """Nudge p_easy / p_hard toward their targets from the groups observed since the last version."""
        n = self.window["groups"]
        if self.warm and n > 0:
            cfg = self.config
            for kind, target in (("easy", cfg.target_easy), ("hard", cfg.target_hard)):
                ratio = self.window[kind] / n
                if ratio > target:
                    self.p[kind] -= cfg.step
                elif ratio < target:
                    self.p[kind] += cfg.step
                self.p[kind] = min(cfg.p_max, max(cfg.p_min, round(self.p[kind], 12)))
        self.window = {"groups": 0, "easy": 0, "hard": 0}

    def _end_warmup(self) -> None:
        self.warm = True
        self.offered = set()

    def state_dict(self) -> dict[str, Any]:
        """Streaks, probabilities, window, warm-up progress, counters and the RNG state."""
        version, internal, gauss = self.rng.getstate()
        return {
            "p": dict(self.p),
            "streaks": {k: [z, kind] for k, (z, kind) in self.streaks.items()},
            "window": dict(self.window),
            "warm": self.warm,
            "offered": sorted(self.offered),
            "observed": self.observed,
            "counts": dict(self.counts),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned; the next random draws match the saved run's."""
        self.p = {k: float(v) for k, v in state["p"].items()}
        self.streaks = {k: (int(z), kind) for k, (z, kind) in state["streaks"].items()}
        self.window = {k: int(v) for k, v in state["window"].items()}
        self.warm = bool(state["warm"])
        self.offered = set(state["offered"])
        self.observed = int(state["observed"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))

    def metrics(self) -> dict[str, float]:
        """submitted, skipped, skipped_easy, skipped_hard (cumulative) and the current p_easy, p_hard."""
        return {
            **{k: float(v) for k, v in self.counts.items()},
            "p_easy": self.p["easy"],
            "p_hard": self.p["hard"],
        }

"""curriculum: admit a prompt only once the policy is competent enough for its difficulty.

Every prompt has a difficulty in [0, 1]: the sample's `difficulty_key` field rescaled from
[difficulty_min, difficulty_max], or, when the sample has no such field, one minus the prompt's own
observed success (prompts never observed count as `unknown`, easiest by default, so they get measured).

The policy's competence is an EWMA of the mean reward (clamped to [0, 1]) of every group observed.
Once per policy version the frontier moves to `start + (1 - start) * min(1, competence / full_at)` and
never moves back; a prompt is submitted when its difficulty is at most the frontier. So the run begins
on the easy prompts and admits harder ones as the policy's success rises. If a prompt is skipped
again before any prompt was admitted since its last skip (a whole pass over the prompt source was
skipped), the frontier jumps to the easiest skipped difficulty, so a curriculum never starves a run.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from astraflow.data.base import Curator, StageConfig


class CurriculumConfig(StageConfig):
    """Options of the curriculum curator."""

    difficulty_key: str = "difficulty"
    """Sample field holding the prompt's difficulty (a number)."""
    difficulty_min: float = 0.0
    """Value of the field for the easiest prompts (maps to 0)."""
    difficulty_max: float = 1.0
    """Value of the field for the hardest prompts (maps to 1), e.g. 5 for MATH levels 1-5."""
    unknown: float = Field(0.0, ge=0, le=1)
    """Difficulty of a prompt with no field that was never observed."""
    start: float = Field(0.3, ge=0, le=1)
    """Frontier at competence 0: the hardest difficulty admitted from the first step."""
    full_at: float = Field(0.7, gt=0, le=1)
    """Competence at which every difficulty is admitted."""
    decay: float = Field(0.9, ge=0, lt=1)
    """EWMA decay of the competence and of each prompt's observed success."""

    @model_validator(mode="after")
    def _check(self) -> CurriculumConfig:
        if self.difficulty_max <= self.difficulty_min:
            raise ValueError("difficulty_max must be greater than difficulty_min")
        return self


class CurriculumCurator(Curator):
    """Gates prompts by difficulty behind a frontier that advances with the policy's success."""

    Config = CurriculumConfig
    config: CurriculumConfig

    def __init__(self, config: CurriculumConfig | None = None, *, policy: str = "", seed: int = 0) -> None:
        super().__init__(config, policy=policy, seed=seed)
        self.frontier = self.config.start
        self.competence = 0.0
        self.success: dict[str, float] = {}
        self.skip_run: set[str] = set()
        """Prompts skipped since the last admission."""
        self.min_skipped = 1.0
        self.counts: dict[str, int] = {"submitted": 0, "skipped": 0}

    def difficulty(self, key: str, sample: dict[str, Any]) -> float:
        """The prompt's difficulty in [0, 1]."""
        cfg = self.config
        raw = sample.get(cfg.difficulty_key)
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            d = (float(raw) - cfg.difficulty_min) / (cfg.difficulty_max - cfg.difficulty_min)
            return min(1.0, max(0.0, d))
        if key in self.success:
            return 1.0 - self.success[key]
        return cfg.unknown

    def submit(self, key: str, sample: dict[str, Any]) -> bool:
        """True when the prompt's difficulty is within the frontier."""
        d = self.difficulty(key, sample)
        if key in self.skip_run and d > self.frontier + 1e-12:
            # A whole pass was skipped: open the frontier to the easiest prompt of that pass.
            self.frontier = max(self.frontier, min(self.min_skipped, d))
        if d <= self.frontier + 1e-12:
            self.skip_run = set()
            self.min_skipped = 1.0
            self.counts["submitted"] += 1
            return True
        self.counts["skipped"] += 1
        self.skip_run.add(key)
        self.min_skipped = min(self.min_skipped, d)
        return False

    def observe(self, key: str, rewards: list[float]) -> None:
        """Fold the group's mean reward into the competence and the prompt's success."""
        if not rewards:
            return
        s = min(1.0, max(0.0, sum(rewards) / len(rewards)))
        d = self.config.decay
        self.competence = d * self.competence + (1 - d) * s
        self.success[key] = d * self.success.get(key, s) + (1 - d) * s

    def on_version(self, version: int) -> None:
        """Advance the frontier from the current competence (it never retreats)."""
        cfg = self.config
        target = cfg.start + (1 - cfg.start) * min(1.0, self.competence / cfg.full_at)
        self.frontier = max(self.frontier, target)

    def state_dict(self) -> dict[str, Any]:
        """Frontier, competence, per-prompt success, skip-pass progress and counters."""
        return {
            "frontier": self.frontier,
            "competence": self.competence,
            "success": dict(self.success),
            "skip_run": sorted(self.skip_run),
            "min_skipped": self.min_skipped,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.frontier = float(state["frontier"])
        self.competence = float(state["competence"])
        self.success = {k: float(v) for k, v in state["success"].items()}
        self.skip_run = set(state["skip_run"])
        self.min_skipped = float(state["min_skipped"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}

    def metrics(self) -> dict[str, float]:
        """submitted, skipped (cumulative), frontier and competence (current)."""
        return {
            **{k: float(v) for k, v in self.counts.items()},
            "frontier": self.frontier,
            "competence": self.competence,
        }

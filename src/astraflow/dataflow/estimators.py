"""Advantage estimators: built-in ones and the `astraflow.advantages` plugin group, in plain Python.

An estimator turns rewards into advantages in two stages, both in the controller (which imports no
torch): `group` once per finished group (same task, policy and group key) when the group is stored,
and `batch` once per served batch (every sequence of one optimizer step, replayed ones included) just
before the batch goes to the trainer. The buffer keeps the group-stage value; a recorded batch served
again is normalised again from the same values, so it reaches the trainer unchanged.

Built in: `grpo` and `drgrpo` (dataflow/advantages.py), `rloo`, `reinforce_pp` and `gae`. `gae` is
per-token PPO: its group stage only passes each sequence's reward on; the trainer computes per-token
advantages from a value model it trains alongside the policy (trainers/critic.py, losses/value.py).

Large rewards: rloo and reinforce_pp scale a group (or batch) by a power of two before summing, which
is exact, so the result is finite whenever the true advantage is a finite float; otherwise, and for
non-finite rewards, they raise ValueError, which the pipeline turns into a refused result (grpo and
drgrpo come from dataflow/advantages.py, whose non-finite results are refused the same way).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from astraflow.dataflow.advantages import group_advantages

EPS = 1e-5


class AdvantageEstimator:
    """Base class of an advantage estimator plugin (entry-point group `astraflow.advantages`).

    Subclasses override `group` and, when they normalise over the whole batch, set `batch_level`
    and override `batch`. `Config` (a pydantic model) validates `policy.advantage_options`."""

    Config: ClassVar[type[BaseModel] | None] = None
    batch_level: ClassVar[bool] = False
    """True when `batch` changes advantages (the controller skips the call otherwise)."""

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = config

    def group(self, rewards: list[float]) -> list[float]:
        """Advantages of one group's sequences, in the order of `rewards`."""
        raise NotImplementedError

    def batch(self, advantages: list[float]) -> list[float]:
        """Advantages of one batch given their group-stage values (default: unchanged)."""
        return list(advantages)


def _scale(xs: list[float]) -> float:
    """A power of two s with max |x| / s in [1, 2) (1.0 for all zeros): dividing by it is exact."""
    for x in xs:
        if not math.isfinite(x):
            raise ValueError(f"non-finite reward or advantage {x!r}: advantages need finite rewards")
    top = max((abs(x) for x in xs), default=0.0)
    return 1.0 if top == 0.0 else math.ldexp(1.0, math.frexp(top)[1] - 1)


def _finite(out: list[float]) -> list[float]:
    if not all(math.isfinite(a) for a in out):
        raise ValueError("advantages overflow a float (rewards of magnitude near 1e308)")
    return out


class GRPOEstimator(AdvantageEstimator):
    """(r - mean) / (std + 1e-5) over the group, unbiased std (a singleton group gets 0)."""

    def group(self, rewards: list[float]) -> list[float]:
        return group_advantages(rewards, "grpo")


class DrGRPOEstimator(AdvantageEstimator):
    """r - mean over the group (no std division)."""

    def group(self, rewards: list[float]) -> list[float]:
        return group_advantages(rewards, "drgrpo")


class RLOOEstimator(AdvantageEstimator):
    """Leave-one-out baseline: A_i = r_i - mean of the other rewards of the group, which equals
    n / (n - 1) * (r_i - mean). A singleton group has no baseline and gets 0."""

    def group(self, rewards: list[float]) -> list[float]:
        n = len(rewards)
        s = _scale(rewards)
        if n < 2:
            return [0.0] * n
        xs = [r / s for r in rewards]
        total = math.fsum(xs)
        return _finite([(x - (total - x) / (n - 1)) * s for x in xs])


class ReinforcePPConfig(BaseModel):
    """Options of `reinforce_pp` (policy.advantage_options)."""

    model_config = ConfigDict(extra="forbid")
    eps: float = Field(EPS, gt=0)
    """Added to the batch std before dividing."""


class ReinforcePPEstimator(AdvantageEstimator):
    """REINFORCE++ with baseline: the group mean is subtracted (A_i = r_i - mean_g), then the whole
    batch is normalised, A <- (A - mean_B) / (std_B + eps), with the population std over the batch's
    sequences (each sequence counts once, whatever its length). A batch of one sequence gets 0."""

    Config = ReinforcePPConfig
    batch_level = True

    def __init__(self, config: BaseModel | None = None) -> None:
        super().__init__(config if config is not None else ReinforcePPConfig())

    def group(self, rewards: list[float]) -> list[float]:
        n = len(rewards)
        s = _scale(rewards)
        xs = [r / s for r in rewards]
        mean = math.fsum(xs) / max(n, 1)
        return _finite([(x - mean) * s for x in xs])

    def batch(self, advantages: list[float]) -> list[float]:
        n = len(advantages)
        if n == 0:
            return []
        s = _scale(advantages)
        xs = [a / s for a in advantages]
        mean = math.fsum(xs) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / n) * s
        eps = self.config.eps if isinstance(self.config, ReinforcePPConfig) else EPS
        # (x - mean) * s / (std + eps): the scaled difference is below 4, the quotient is bounded.
        return _finite([((x - mean) * s) / (std + eps) if std > 0 else 0.0 for x in xs])


class GAEConfig(BaseModel):
    """Options of `gae` (policy.advantage_options): the discount, the GAE lambda and the value model."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per trained token."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda: 0 is the one-step TD advantage, 1 the Monte-Carlo return minus the value."""
    value_clip: float = Field(0.2, gt=0)
    """A new value prediction counts at most this far from the one taken before the step (clipped loss)."""
    critic_lr: float | None = Field(None, gt=0)
    """Learning rate of the value model's AdamW; None = the policy's optimizer.lr."""
    whiten: bool = True
    """Normalise the batch's per-token advantages to mean 0, std 1 over its trained tokens."""


class GAEEstimator(AdvantageEstimator):
    """PPO with GAE: the group stage keeps each sequence's reward (its return); the trainer turns it into
    per-token advantages with a value model it trains beside the policy (the trainer keys on the name)."""

    Config = GAEConfig

    def __init__(self, config: BaseModel | None = None) -> None:
        super().__init__(config if config is not None else GAEConfig())

    def group(self, rewards: list[float]) -> list[float]:
        _scale(rewards)  # refuses non-finite rewards, as the other estimators do
        return list(rewards)


BUILTIN: dict[str, type[AdvantageEstimator]] = {
    "grpo": GRPOEstimator,
    "drgrpo": DrGRPOEstimator,
    "rloo": RLOOEstimator,
    "reinforce_pp": ReinforcePPEstimator,
    "gae": GAEEstimator,
}
"""Built-in estimators, found before the `astraflow.advantages` plugin group is searched."""


def estimator_class(name: str) -> type[AdvantageEstimator]:
    """The class of estimator `name`: a built-in, else a plugin (a PluginError names what exists)."""
    if name in BUILTIN:
        return BUILTIN[name]
    from astraflow import plugins
    from astraflow.errors import PluginError

    try:
        cls = plugins.load("advantages", name)
    except PluginError as exc:
        raise PluginError(
            f"no advantage estimator named {name!r}",
            hint=f"built in: {', '.join(BUILTIN)}; others come from the astraflow.advantages plugin group",
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, AdvantageEstimator)):
        raise PluginError(
            f"advantage plugin {name!r} is not an AdvantageEstimator subclass",
            hint="subclass astraflow.dataflow.estimators.AdvantageEstimator",
        )
    return cls


def make_estimator(name: str, options: dict[str, Any] | None = None) -> AdvantageEstimator:
    """Estimator `name` with its options validated by its Config (options without a Config are refused)."""
    from pydantic import ValidationError

    from astraflow.errors import RecipeError

    cls = estimator_class(name)
    options = options or {}
    if cls.Config is None:
        if options:
            raise RecipeError(f"advantage estimator {name!r} takes no options, got {sorted(options)}")
        return cls()
    try:
        config = cls.Config.model_validate(options)
    except ValidationError as exc:
        lines = [
            f"  advantage_options.{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()
        ]
        raise RecipeError(f"invalid options for advantage estimator {name!r}:\n" + "\n".join(lines)) from None
    return cls(config)

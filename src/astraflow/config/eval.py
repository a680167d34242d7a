"""The `[eval]` table of a recipe: held-out avg@k / pass@k evaluation every N versions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.protocol.messages import MIN_TEMPERATURE


class EvalSampling(BaseModel):
    """Sampling settings of evaluation episodes; unset fields keep the policy's recipe sampling."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, allow_inf_nan=False)
    """Sampling temperature of evaluation (e.g. 0.6; None = the policy's)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus mass of evaluation (None = the policy's)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest completion of evaluation (None = the policy's)."""

    def overrides(self) -> dict[str, float | int]:
        """The set fields, as PolicyClient.generate overrides."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class EvalConfig(BaseModel):
    """Held-out avg@n / pass@k evaluation every N versions, on tasks never trained on (docs/recipes.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    every_versions: int = Field(0, ge=0)
    """Evaluate each version that is a multiple of this (0: only at start and end)."""
    at_start: bool = True
    """Also evaluate version 0 (the initial weights), the baseline the later rows compare with."""
    at_end: bool = True
    """Also evaluate the policy's last version; its trainer (serving the weights) and the run end after it."""
    path: str = ""
    """JSONL file of held-out samples ("" = the workflow's own dataset() with `options` and `seed`)."""
    options: dict[str, Any] = {}
    """Workflow options for building the held-out set, over workflow.options (episodes use workflow.options)."""
    seed: int | None = None
    """Seed of the workflow's generated held-out set (None = run.seed + 1)."""
    max_tasks: int = Field(32, ge=1)
    """Held-out tasks evaluated per version (the first ones of the set)."""
    samples: int = Field(4, ge=1)
    """Samples per task (n): avg@n is their mean reward; pass@k is estimated from them."""
    k: list[int] = [1]
    """pass@k values written (each at most `samples`)."""
    correct_at: float = 1.0
    """A sample counts as correct for pass@k when its reward is at least this."""
    policies: list[str] = []
    """Policies evaluated ([] = every trainable policy the workflow calls)."""
    sampling: EvalSampling = EvalSampling()
    """Sampling overrides of evaluation episodes (a workflow's own per-call overrides still win)."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        bad = [k for k in self.k if k < 1 or k > self.samples]
        if bad:
            raise ValueError(f"eval.k values must be in [1, eval.samples={self.samples}], got {bad}")
        if not (self.every_versions or self.at_start or self.at_end):
            raise ValueError("eval needs every_versions > 0, at_start or at_end (else nothing is evaluated)")
        return self

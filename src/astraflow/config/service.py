"""The `[[service]]` tables of a recipe: helper processes (an environment server, a retrieval server)
that `astraflow up` starts before the roles and stops after them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServiceConfig(BaseModel):
    """One helper process that `astraflow up` runs for the length of the run (docs/agents.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Name of the service; its output goes to <run-dir>/logs/service-<name>.log."""
    command: list[str] = Field(min_length=1)
    """The command line, no shell; `python` is astraflow's own Python (its directory leads the service's PATH)."""
    ready: str = Field("", pattern=r"^([^:\s]+:\d{1,5})?$")
    """host:port that accepts TCP connections once the service is up; the roles start only then ("" = do not wait)."""
    ready_timeout_s: float = Field(30.0, gt=0)
    """A service not accepting connections on `ready` after this long fails the start of the run."""
    env: dict[str, str] = {}
    """Environment variables set for this service only."""
    max_restarts: int = Field(0, ge=0, le=1000)
    """Times `up` starts it again (old process group killed first) if it exits mid-run; 0: its exit ends the run."""

"""The recipe `astraflow bench control` runs: the quickstart with no model, of a chosen step shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICY = "main"


@dataclass(frozen=True)
class Shape:
    """A step of the bench's policy: `batch_prompts` tasks of `group_size` sequences each (the
    quickstart's 32 x 16 by default). The simulated workers ask for `slots` tasks at a time (0:
    `batch_prompts`), and answer each grant in one message."""

    group_size: int = 16
    batch_prompts: int = 32
    slots: int = 0

    @property
    def request(self) -> int:
        """Tasks a worker asks for at a time (and holds at most)."""
        return self.slots or self.batch_prompts

    def check(self) -> None:
        """Raise ValueError on a shape no recipe takes."""
        if self.group_size < 1 or self.batch_prompts < 1 or self.slots < 0:
            raise ValueError(f"a step shape takes a group size and prompts >= 1 and slots >= 0, not {self}")


def recipe(
    heartbeat_s: float,
    members: int,
    keep_steps: int = 0,
    idle_beats_per_s: float | None = None,
    shape: Shape = Shape(),
    archiver: str = "inline",
) -> dict[str, Any]:
    """The quickstart's workflow with no model, `shape` a step: the controller reads no weights and
    checks ids >= 0; `keep_steps` > 0 turns on retention (archive to Parquet every 10 steps);
    `idle_beats_per_s` sets controller.idle_beats_per_s (None: the recipe's default); `archiver` is
    controller.retention.archiver."""
    shape.check()
    retention = {"keep_steps": keep_steps, "every_steps": 10, "archiver": archiver} if keep_steps else {}
    idle = {} if idle_beats_per_s is None else {"idle_beats_per_s": idle_beats_per_s}
    return {
        "run": {"name": "control-bench", "seed": 0, "steps": 1_000_000},
        "policy": [
            {
                "name": POLICY,
                "model": "unused",
                "group_size": shape.group_size,
                "batch_prompts": shape.batch_prompts,
                "max_staleness": 1,
            }
        ],
        "workflow": {"name": "quickstart", "options": {"task": "copy", "length": 2}},
        "rollout": {"slots": shape.request},
        "controller": {
            "heartbeat_interval_s": heartbeat_s,
            # a loaded machine delays simulators' beats and the reading of 10,000 connections: none dies
            "member_timeout_s": max(120.0, 20 * heartbeat_s),
            "retention": retention,
            **idle,
        },
    }

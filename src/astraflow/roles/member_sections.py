"""Which of the recipe's sections a member's Welcome carries: what its role reads, nothing else.

A rollout worker gets `RaaSSections` (roles/raas_sections.py: the workflow, the policies its roles
map to, `[rollout]`, `[weights]`, the seed), a trainer `TrainerSections` (roles/trainer_sections.py:
its own policy, its budget, the run's name and seed, `[weights]`, whether there is an `[eval]`), an
observer nothing (what it shows comes from StatusReply). So no member receives another policy's
section, the dataset, the controller's settings or the services' commands unless its role reads them.
"""

from __future__ import annotations

from typing import Any

from astraflow.config.recipe import Recipe
from astraflow.roles.raas_sections import RaaSSections
from astraflow.roles.trainer_sections import TrainerSections


def sections_for(recipe: Recipe, role: str, policies: list[str], roles: dict[str, str]) -> dict[str, Any]:
    """The `Welcome.sections` of a member of `role` serving `policies` (`roles`: the run's role map).
    The Hello was checked first (authz.hello_refusal): a trainer names exactly one known policy."""
    if role == "raas":
        return RaaSSections.of(recipe, roles).to_wire()
    if role == "trainer":
        return TrainerSections.of(recipe, policies[0]).to_wire()
    return {}

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


class WelcomeSections:
    """The `Welcome.sections` per kind of member, each dumped at the first Hello of such a member: a
    worker's are the same for every worker, a trainer's are its policy's."""

    def __init__(self, recipe: Recipe, roles: dict[str, str]) -> None:
        self.recipe = recipe
        self.roles = roles
        self.dumped: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        """(role, policies) -> the sections such a member's Welcome carries."""

    def __call__(self, role: str, policies: list[str]) -> dict[str, Any]:
        """What a Welcome carries of the recipe to a member of `role` serving `policies` (checked Hello)."""
        key = (role, tuple(policies) if role == "trainer" else ())
        doc = self.dumped.get(key)
        if doc is None:
            doc = self.dumped[key] = sections_for(self.recipe, role, policies, self.roles)
        return doc

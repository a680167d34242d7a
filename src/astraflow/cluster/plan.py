"""What every cluster backend starts: the same roles, member names and keys as `astraflow up`.

A launch prepares the run directory on this machine before anything is submitted: the resolved recipe
(with model paths made absolute, so that a role started in another directory finds them), and a key
store with one key per member. The backends then only place these roles on nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

DEFAULT_PORT = 7600
"""The controller's TCP port on its node when the launch does not name one."""


@dataclass(frozen=True)
class Member:
    """One member process of the run: a trainer of one policy or a RaaS worker."""

    name: str
    """Member id; also the name of its key pair in RUN/keys/members/."""
    role: str
    """'trainer' or 'raas'."""
    policy: str | None = None
    """The policy a trainer trains."""
    nproc: int = 1
    """Trainer ranks on its node (torchrun, FSDP2); 1 for a RaaS worker."""


@dataclass(frozen=True)
class Plan:
    """The run's roles as a cluster backend starts them."""

    run_dir: Path
    """Absolute run directory (on a filesystem every node sees)."""
    trainers: list[Member]
    raas: list[Member]
    slots: int
    """Concurrent tasks per RaaS worker."""

    @property
    def resolved(self) -> Path:
        """The resolved recipe every role reads."""
        return self.run_dir / "recipe.resolved.json"

    @property
    def keys(self) -> Path:
        """The controller's key store."""
        return self.run_dir / "keys"

    def secret(self, member: str) -> Path:
        """A member's secret key file."""
        return self.keys / "members" / f"{member}.key_secret"


def absolute_models(recipe: Any, base: Path) -> None:
    """Make every policy's model path absolute (relative paths are read from `base`)."""
    for pol in recipe.policy:
        if not Path(pol.model).is_absolute():
            pol.model = str((base / pol.model).resolve())


def make_plan(recipe: Any, run_dir: Path, raas_workers: int | None = None) -> Plan:
    """The members a recipe needs: one trainer per trainable policy, `raas_workers` RaaS workers
    (default the recipe's rollout.local_workers, at least one)."""
    count = recipe.rollout.local_workers if raas_workers is None else raas_workers
    if count < 1:
        raise AstraflowError(
            "a cluster run needs at least one RaaS worker", hint="pass --raas N or set rollout.local_workers"
        )
    trainers = [Member(f"trainer-{p.name}", "trainer", p.name, p.trainer_nproc) for p in recipe.trainable()]
    raas = [Member(f"raas-{i}", "raas") for i in range(count)]
    return Plan(run_dir.resolve(), trainers, raas, recipe.rollout.slots)


def prepare_run(recipe: Any, plan: Plan, raas_names: list[str] | None = None) -> None:
    """Write the run directory (resolved recipe, meta) and its keys (for `raas_names`, default the
    plan's workers); an existing run must have been made from the same recipe (it is resumed, as a
    controller restarted by hand would)."""
    from astraflow.config.recipe_change import check_run_recipe
    from astraflow.launch.up import throwaway_keys
    from astraflow.models.dirs import check_models
    from astraflow.rundir import prepare

    check_models(recipe)
    check_run_recipe(plan.run_dir, recipe, allow=False)
    prepare(plan.run_dir, recipe)
    throwaway_keys(
        plan.keys,
        [(m.name, m.role, m.policy) for m in plan.trainers]
        + [(n, "raas", None) for n in (raas_names or [m.name for m in plan.raas])]
        + [("observer", "observer", None), ("operator", "operator", None)],
    )

"""A controller restarted on an existing run must run the recipe the run was started with.

A changed recipe would silently change what the stored state means (group sizes, policies, data
stages, losses), so any difference is refused with a readable diff. `--allow-recipe-change` lets
through only the fields below, which change how the run is operated, not what it computes.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.errors import RecipeError

if TYPE_CHECKING:
    from astraflow.config.recipe import Recipe

CHANGEABLE = (
    "run.steps",
    "rollout.local_workers",
    "rollout.slots",
    "rollout.threads",
    "rollout.lease_timeout_s",
    "rollout.task_timeout_s",
    "rollout.max_attempts",
    "rollout.max_failed_tasks",
    "rollout.drain_timeout_s",
    "rollout.gpus",
    "rollout.autoscale*",
    "controller.*",
    "weights.keep_versions",
    "policy[*].threads",
    "policy[*].checkpoint_every",
    "policy[*].trainer_gpus",
)
"""Fields `--allow-recipe-change` lets differ (run.steps may only grow)."""


def diff(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, old value, new value) of every leaf that differs between two recipe documents."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(old) | set(new)):
            sub = f"{path}.{k}" if path else str(k)
            out.extend(diff(old.get(k), new.get(k), sub))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out.extend(diff(a, b, f"{path}[{i}]"))
        return out
    return [] if old == new else [(path, old, new)]


def _changeable(path: str, old: Any, new: Any) -> bool:
    if path == "run.steps":
        return isinstance(old, int) and isinstance(new, int) and new >= old
    # list indices become '#' on both sides ('[*]' would be a character class to fnmatch)
    generic = "".join("#" if part.endswith("]") else part for part in _split_index(path))
    return any(
        fnmatch.fnmatchcase(generic, pat.replace("[*]", "#")) for pat in CHANGEABLE if pat != "run.steps"
    )


def _split_index(path: str) -> list[str]:
    """'policy[0].threads' -> ['policy', '[0]', '.threads'] so indices can be generalised."""
    out, cur = [], ""
    for ch in path:
        if ch == "[":
            out.append(cur)
            cur = "["
        elif ch == "]":
            out.append(cur + "]")
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [p for p in out if p]


def _show(v: Any) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def check_recipe_change(stored: dict[str, Any], current: dict[str, Any], *, allow: bool) -> bool:
    """Raise RecipeError (with the diff) if the recipe differs and that is not allowed; True if it differs."""
    changes = diff(stored, current)
    if not changes:
        return False
    lines = [f"  {p}: {_show(a)} -> {_show(b)}" for p, a, b in changes]
    forbidden = [c for c in changes if not _changeable(*c)]
    if not allow:
        raise RecipeError(
            "the recipe differs from the one this run was started with:\n" + "\n".join(lines),
            hint="restart with the run's recipe (recipe.resolved.json); to change only "
            f"{', '.join(CHANGEABLE)} (run.steps may only grow), pass --allow-recipe-change",
        )
    if forbidden:
        bad = [f"  {p}: {_show(a)} -> {_show(b)}" for p, a, b in forbidden]
        raise RecipeError(
            "--allow-recipe-change allows only operational fields; these may not change:\n" + "\n".join(bad),
            hint=f"changeable: {', '.join(CHANGEABLE)} (run.steps may only grow)",
        )
    return True


def check_run_recipe(run_dir: Path, recipe: Recipe, *, allow: bool) -> None:
    """If run_dir already holds a run, its stored recipe must match (see check_recipe_change)."""
    from astraflow.state.store import Store

    db = Path(run_dir) / "state.db"
    if not db.is_file():
        return
    store = Store.open_readonly(db)
    try:
        run = store.run()
    except Exception:  # an empty or foreign file: the controller's own open reports it
        return
    finally:
        store.close()
    if run is not None:
        check_recipe_change(run["recipe"], recipe.model_dump(mode="json"), allow=allow)

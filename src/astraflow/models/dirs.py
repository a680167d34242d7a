"""Model directories: the one check that a policy's model directory is there, made by `up` before any
process starts (building a missing one from policy.model_init) and by each member as it joins."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow import log

if TYPE_CHECKING:
    from astraflow.config.recipe import PolicyConfig, Recipe
    from astraflow.transport.client import MemberClient

_log = log.get("launcher")


def check_models(recipe: Recipe, source: Path | None = None) -> None:
    """Every policy's model directory must exist before any process starts: a missing one the recipe
    says how to make (policy.model_init) is built here; one without config.json is refused. A missing
    one the recipe file (`source`) makes by commands in its comments is refused naming those."""
    for pol in recipe.policy:
        require_model_dir(pol, build=True, source=source)


def recipe_commands(source: Path, model: str) -> list[str]:
    """The `astraflow` commands a recipe file's comments give for making `model`: every one before (and
    with) the first that writes `--out MODEL` (a model init, then an sft of it); [] when none does."""
    try:
        lines = source.read_text(errors="replace").splitlines()
    except OSError:
        return []
    cmds = [ln.lstrip("#").strip() for ln in lines if ln.lstrip("#").strip().startswith("astraflow ")]
    cmds = [c for c in cmds if not c.startswith(("astraflow up ", "astraflow launch "))]
    for i, cmd in enumerate(cmds):
        if cmd.split("--out ", 1)[-1].split(" ", 1)[0].rstrip("/") == model.rstrip("/") and "--out " in cmd:
            return cmds[: i + 1]
    return []


def require_model_dirs(policies: list[PolicyConfig], client: MemberClient | None = None) -> None:
    """A member's check as it joins: every model it loads exists on this machine (the recipe names a
    path that each machine has); the client, if given, is closed before the error is raised."""
    from astraflow.errors import AstraflowError

    for pol in policies:
        try:
            require_model_dir(pol, here=True)
        except AstraflowError:
            if client is not None:
                client.close("model directory missing")
            raise


def require_model_dir(
    pol: Any, *, build: bool = False, here: bool = False, source: Path | None = None
) -> None:
    """`pol.model` must be a model directory. build: make a missing one from pol.model_init first and
    refuse one without config.json (`up`, before anything starts); here: the path is missing on this
    machine of a cluster (a member joining), where copying it over is the fix; source: the recipe file,
    whose comments may say how its model is made."""
    from astraflow.errors import AstraflowError, RecipeError

    path = Path(pol.model)
    init = getattr(pol, "model_init", None)
    if build and not path.exists() and init is not None:
        build_model(init, path)
    make = f"astraflow model init --arch qwen3 --preset tiny --out {pol.model}"
    if not path.is_dir() and here:
        raise AstraflowError(
            f"policy {pol.name!r}: model directory {pol.model!r} does not exist on this machine",
            hint="copy the model directory to the same path here (or use a shared filesystem); "
            f"to make a random-init one: {make}",
        )
    if not path.is_dir():
        made = init.command(pol.model) if init is not None else None
        own = recipe_commands(source, pol.model) if source is not None and made is None else []
        raise RecipeError(
            f"policy {pol.name!r}: model directory {pol.model!r} does not exist",
            hint=f"create it: {made}"
            if made
            else f"create it as the recipe's comments say: {'; '.join(own)}"
            if own
            else f"add policy.model_init to the recipe (docs/recipes.md) or create one offline: {make}",
        )
    if build and not (path / "config.json").is_file():
        raise RecipeError(
            f"policy {pol.name!r}: {pol.model!r} is not a model directory (no config.json)",
            hint="point policy.model at a transformers model directory (astraflow model init makes one)",
        )


def build_model(init: Any, out: Path) -> None:
    """Build a policy's random-init model as its recipe's model_init says (`astraflow model init`)."""
    from astraflow.errors import RecipeError
    from astraflow.models.init import init_model

    if init.tokenizer == "bpe" and (init.corpus is None or not Path(init.corpus).is_file()):
        raise RecipeError(
            f"model_init for {out}: corpus {init.corpus!r} is not a file",
            hint="policy.model_init.corpus names the text the bpe tokenizer is trained on",
        )
    _log.info("building %s: %s", out, init.command(str(out)))
    init_model(
        init.arch,
        init.preset,
        out,
        init.seed,
        tokenizer=init.tokenizer,
        corpus=Path(init.corpus) if init.corpus else None,
        vocab_size=init.vocab_size,
    )

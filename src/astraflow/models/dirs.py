"""The model directories a run needs, checked (and built from policy.model_init) before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow import log

_log = log.get("launcher")


def check_models(recipe: Any) -> None:
    """Every policy's model directory must exist before any process starts: a missing one the recipe
    says how to make (policy.model_init) is built here; one without config.json is refused."""
    from astraflow.errors import RecipeError

    for pol in recipe.policy:
        path = Path(pol.model)
        if not path.exists() and pol.model_init is not None:
            build_model(pol.model_init, path)
        if not path.is_dir():
            made = pol.model_init.command(pol.model) if pol.model_init is not None else None
            raise RecipeError(
                f"policy {pol.name!r}: model directory {pol.model!r} does not exist",
                hint=f"create it: {made}"
                if made
                else "add policy.model_init to the recipe (docs/recipes.md) or create one offline: "
                f"astraflow model init --arch qwen3 --preset tiny --out {pol.model}",
            )
        if not (path / "config.json").is_file():
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

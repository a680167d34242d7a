"""Render the recipe field reference (docs/recipes.md) from the models themselves, so docs match code."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from astraflow.config.recipe import Recipe


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if isinstance(value, BaseModel):
        return "(table)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "(tables)"
    return "`" + json.dumps(value) + "`"


def _walk(model: type[BaseModel], prefix: str, out: list[str], seen: set[str]) -> None:
    rows = []
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = None
        args = getattr(ann, "__args__", ())
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sub = ann
        elif args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            sub = args[0]
        key = f"{prefix}{name}"
        if sub is not None:
            type_txt = "table"
        elif isinstance(ann, type):
            type_txt = ann.__name__
        else:
            type_txt = str(ann).replace("typing.", "")
        rows.append(f"| `{key}` | {type_txt} | {_default(field)} | {(field.description or '').strip()} |")
        if sub is not None and sub.__name__ not in seen:
            nested.append((f"{key}.", sub))
    out.append(
        f"\n### `{prefix.rstrip('.') or '(top level)'}` — {model.__doc__.strip() if model.__doc__ else ''}\n"
    )
    out.append("| key | type | default | meaning |")
    out.append("|---|---|---|---|")
    out.extend(rows)
    for pfx, sub in nested:
        seen.add(sub.__name__)
        _walk(sub, pfx, out, seen)


def render_reference() -> str:
    """The Markdown field reference of a recipe, generated from the pydantic models."""
    out: list[str] = []
    _walk(Recipe, "", out, {"Recipe"})
    return "\n".join(out).strip() + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render_reference())

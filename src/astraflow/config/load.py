"""Load a recipe: TOML file, dotted --set overrides, validation, resolved dump."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from astraflow.config.recipe import Recipe
from astraflow.errors import PluginError, RecipeError

M = TypeVar("M")


def parse_value(text: str) -> Any:
    """Parse an override value as TOML (numbers, bools, arrays, quoted strings), else keep the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data[a][b]... = value; a numeric part indexes a list (policy.0.lr), a bare policy table
    key (policy.lr) applies to every policy."""
    parts = dotted.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if part.isdigit():
                node = node[int(part)]
                continue
            for item in node:
                apply_override(item, ".".join(parts[i:]), value)
            return
        node = node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise RecipeError(f"--set {dotted}: {'.'.join(parts[: i + 1])} is not a table")
    last = parts[-1]
    if isinstance(node, list):
        if last.isdigit():
            node[int(last)] = value
        else:
            for item in node:
                item[last] = value
    else:
        node[last] = value


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe, raising RecipeError with every problem listed."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(
            f"recipe not found: {p}",
            hint="pass the path of a .toml recipe, e.g. recipes/quickstart/recipe.toml",
        )
    data = read_recipe_data(p)
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE", hint="e.g. --set run.steps=20")
        key, _, raw = item.partition("=")
        apply_override(data, key.strip(), parse_value(raw.strip()))
    return validate_recipe(data, source=str(p))


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; anything else (values, arrays, [[policy]] lists) is replaced.
    A [[policy]] list of the same length merges element by element, so a variant can change one field."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        if isinstance(b, dict) and isinstance(v, dict):
            out[k] = deep_merge(b, v)
        elif k == "policy" and isinstance(b, list) and isinstance(v, list) and len(b) == len(v):
            out[k] = [
                deep_merge(x, y) if isinstance(x, dict) and isinstance(y, dict) else y
                for x, y in zip(b, v, strict=True)
            ]
        else:
            out[k] = v
    return out


def read_recipe_data(p: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Parse a recipe file; `extends = "base.toml"` (relative to the file) merges it over its base."""
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise RecipeError(f"{p}: not valid {kind}: {exc}", hint="check the line named above") from exc
    base_name = data.pop("extends", None)
    unset = data.pop("unset", None)
    if base_name is None:
        if unset is not None:
            raise RecipeError(f"{p}: `unset` removes keys of the base recipe; this recipe has no `extends`")
        return data
    base = (p.parent / str(base_name)).resolve()
    if base in _seen or base == p.resolve():
        raise RecipeError(f"{p}: `extends` forms a cycle through {base}")
    if not base.is_file():
        raise RecipeError(f"{p}: extends {base_name!r}, which does not exist", hint=f"looked for {base}")
    merged = read_recipe_data(base, (*_seen, p.resolve()))
    if unset is not None:
        if not isinstance(unset, list) or not all(isinstance(k, str) and k for k in unset):
            raise RecipeError(f'{p}: `unset` must be a list of dotted keys, e.g. ["eval", "policy.0.data"]')
        for key in unset:
            remove_key(merged, key, f"{p}: unset {key!r}")
    return deep_merge(merged, data)


def remove_key(data: dict[str, Any], dotted: str, where: str) -> None:
    """Delete `a.b.c` (a digit addresses a [[policy]] element by index) from a recipe dict; a key the
    base does not have is an error, so a misspelt key is not silently ignored."""
    parts = dotted.split(".")
    node: Any = data
    for part in parts[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise RecipeError(f"{where}: the base recipe has no {part!r} there")
    last = parts[-1]
    if isinstance(node, dict) and last in node:
        del node[last]
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        del node[int(last)]
    else:
        raise RecipeError(f"{where}: the base recipe has no {last!r} there")


def validate_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a recipe dict into a Recipe, with pydantic's errors rendered one per line."""
    return validate_section(Recipe, data, source, what="recipe")


def validate_section(model: type[M], data: Any, source: str, what: str = "recipe section") -> M:
    """Validate one recipe section (or a whole recipe) into `model` (a pydantic model, or a dataclass
    pydantic can validate: the sections a member receives), with pydantic's errors rendered one per
    line."""
    from pydantic import TypeAdapter

    try:
        if isinstance(model, type) and issubclass(model, BaseModel):
            return model.model_validate(data)
        return TypeAdapter(model).validate_python(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"  {loc}: {err['msg']}")
        raise RecipeError(
            f"{source} is not a valid {what}:\n" + "\n".join(lines),
            hint="`astraflow recipe show` prints the resolved recipe; docs/recipes.md lists every field",
        ) from None


def validate_options(group: str, name: str, options: dict[str, Any], where: str) -> BaseModel | None:
    """Validate a plugin's options table against the plugin's own Config model (if it has one)."""
    from astraflow import plugins

    config_cls = plugins.options_model(group, name)
    if config_cls is None:
        config_cls = getattr(plugins.load(group, name), "Config", None)
    if config_cls is None:
        if options:
            raise RecipeError(f"{where}: plugin {name!r} takes no options, got {sorted(options)}")
        return None
    try:
        return config_cls.model_validate(options)
    except ValidationError as exc:
        lines = [f"  {where}.{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise RecipeError(f"invalid options for plugin {name!r}:\n" + "\n".join(lines)) from None


def _validate_advantage(name: str, options: dict[str, Any], where: str) -> None:
    """An advantage estimator is a plugin of `astraflow.advantages` (the built-ins register there too,
    so the recipe's check needs no import of dataflow/)."""
    from astraflow import plugins

    try:
        validate_options("advantages", name, options, where)
    except PluginError as exc:
        if not str(exc).startswith(f"no plugin named {name!r}"):
            raise  # installed but broken, or registered twice: that error says more
        known = sorted({ep.name for ep in plugins.group_entries("astraflow.advantages")})
        raise PluginError(
            f"no advantage estimator named {name!r}",
            hint=f"installed: {', '.join(known)} (the astraflow.advantages plugin group)",
        ) from exc


def validate_plugins(recipe: Recipe, *, torch_plugins: bool = True) -> None:
    """Check that every plugin named by the recipe is installed and accepts its options.

    torch_plugins=False leaves out the engines and trainers (their modules import torch): for a
    controller whose launcher has checked them already, as `astraflow up` does."""
    validate_options("workflows", recipe.workflow.name, recipe.workflow.options, "workflow.options")
    from astraflow import plugins

    wf_cls = plugins.load("workflows", recipe.workflow.name)
    roles = tuple(getattr(wf_cls, "roles", ("actor",)))
    if recipe.workflow.roles and getattr(wf_cls, "any_roles", False):
        pass  # the workflow serves whatever roles the recipe names
    elif recipe.workflow.roles:
        optional = set(getattr(wf_cls, "optional_roles", ()))
        unknown = [r for r in recipe.workflow.roles if r not in roles and r not in optional]
        if unknown:
            raise RecipeError(
                f"workflow.roles maps roles {unknown} that workflow {recipe.workflow.name!r} does not have",
                hint=f"its roles: {', '.join(roles + tuple(sorted(optional)))}",
            )
        missing = [r for r in roles if r not in recipe.workflow.roles]
        if missing:
            raise RecipeError(
                f"workflow.roles does not map roles {missing} of workflow {recipe.workflow.name!r}"
            )
    elif len(recipe.policy) != 1 and len(roles) != 1:
        raise RecipeError(
            "workflow.roles is empty but the recipe has several policies",
            hint=f"map each role of {recipe.workflow.name!r} ({', '.join(roles)}) to a policy",
        )
    mapped = set(role_map(recipe).values())
    idle = [p.name for p in recipe.policy if p.trainable and p.name not in mapped]
    if idle:
        raise RecipeError(
            f"trainable policies {idle} play no role of workflow {recipe.workflow.name!r}: they would never train",
            hint="map a role to each in workflow.roles, or set trainable = false",
        )
    for i, pol in enumerate(recipe.policy):
        validate_options("losses", pol.loss, pol.loss_options, f"policy.{i}.loss_options")
        _validate_advantage(pol.advantage, pol.advantage_options, f"policy.{i}.advantage_options")
        for j, stage in enumerate(pol.data):
            validate_options("data", stage.name, stage.options, f"policy.{i}.data.{j}.options")
        # engines and trainers may import torch (seconds); the built-in ones register their options
        # models apart (plugins.OPTIONS_GROUP), so checking them here imports no torch
        if not torch_plugins:
            continue
        validate_options("engines", pol.engine, pol.engine_options, f"policy.{i}.engine_options")
        validate_options("trainers", pol.trainer, pol.trainer_options, f"policy.{i}.trainer_options")
    for i, sink in enumerate(recipe.metrics.sinks):
        validate_options("metric_sinks", sink.name, sink.options, f"metrics.sinks.{i}.options")


def role_map(recipe: Recipe) -> dict[str, str]:
    """Workflow role -> policy name, filling the single-policy default."""
    if recipe.workflow.roles:
        return dict(recipe.workflow.roles)
    from astraflow import plugins

    wf_cls = plugins.load("workflows", recipe.workflow.name)
    roles = tuple(getattr(wf_cls, "roles", ("actor",)))
    return {r: recipe.policy[0].name for r in roles}


def dump_resolved(recipe: Recipe, path: Path) -> None:
    """Write the resolved recipe as JSON (what the run actually used)."""
    path.write_text(json.dumps(recipe.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")

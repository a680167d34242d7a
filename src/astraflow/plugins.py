"""Entry-point plugin registry. Listing imports nothing; loading imports one plugin."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from astraflow.errors import PluginError

GROUPS: tuple[str, ...] = (
    "astraflow.engines",
    "astraflow.trainers",
    "astraflow.workflows",
    "astraflow.data",
    "astraflow.losses",
    "astraflow.metric_sinks",
)


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, described without importing it."""

    group: str
    name: str
    target: str
    distribution: str


def list_plugins(group: str | None = None) -> dict[str, list[PluginInfo]]:
    """Installed plugins per group, read from package metadata only."""
    out: dict[str, list[PluginInfo]] = {}
    for g in GROUPS if group is None else (group,):
        rows = []
        for ep in entry_points(group=g):
            dist = ep.dist.name if ep.dist is not None else "?"
            rows.append(PluginInfo(g, ep.name, ep.value, dist))
        out[g] = sorted(rows, key=lambda p: p.name)
    return out


OPTIONS_GROUP = "astraflow.options"
"""Where a plugin whose module is heavy to import may register its options model apart from its code,
under the name `<group>.<name>` (e.g. `engines.torch`), so a recipe's options are checked without it."""


def options_model(group: str, name: str) -> Any | None:
    """The options model registered for plugin `name` of `group` in OPTIONS_GROUP (imported without
    the plugin's own module), or None if it registered none; fails like `load` if the plugin is missing."""
    group = group.removeprefix("astraflow.")
    _entry(f"astraflow.{group}", name)
    matches = [ep for ep in entry_points(group=OPTIONS_GROUP) if ep.name == f"{group}.{name}"]
    if len({ep.value for ep in matches}) != 1:
        return None  # none, or ambiguous: the plugin's own Config decides
    try:
        return matches[0].load()
    except Exception:
        return None  # the plugin's own Config decides (and `load` reports a broken install)


def load(group: str, name: str) -> Any:
    """Import and return the object registered as `name` in `group`, or fail with what is installed."""
    if not group.startswith("astraflow."):
        group = f"astraflow.{group}"
    ep = _entry(group, name)
    try:
        return ep.load()
    except Exception as exc:  # a broken third-party plugin must not look like our bug
        raise PluginError(
            f"plugin {name!r} in {group} failed to import: {exc}",
            hint=f"check the package that provides {ep.value}",
        ) from exc


def _entry(group: str, name: str) -> Any:
    """The one entry point registered as `name` in `group`; a missing or duplicate name is a PluginError."""
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        have = ", ".join(sorted({ep.name for ep in entry_points(group=group)})) or "none"
        raise PluginError(
            f"no plugin named {name!r} in {group}",
            hint=f"installed: {have}; `astraflow plugins` lists every group",
        )
    targets = sorted({ep.value for ep in matches})
    if len(targets) > 1:
        raise PluginError(
            f"plugin name {name!r} in {group} is registered more than once: {', '.join(targets)}",
            hint="uninstall one of the distributions that provide it",
        )
    return matches[0]

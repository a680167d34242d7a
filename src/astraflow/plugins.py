"""Entry-point plugin registry. Listing imports nothing; loading imports one plugin."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from astraflow.errors import PluginError

GROUPS: tuple[str, ...] = (
    "astraflow.engines",
    "astraflow.trainers",
    "astraflow.workflows",
    "astraflow.data",
    "astraflow.losses",
    "astraflow.advantages",
    "astraflow.metric_sinks",
)


def group_entries(group: str) -> list[EntryPoint]:
    """The entry points registered in `group`, from metadata read once per state of the import path.

    Each `entry_points()` call parses every installed distribution's metadata (20-30 ms with a few
    hundred packages) and a process starting a run asks a dozen times. Installing or removing a
    distribution changes its directory's modification time, so a new plugin is still seen at once."""
    return list(_all_entries(_path_state()).select(group=group))


@functools.lru_cache(maxsize=4)
def _all_entries(_path: tuple[tuple[str, int], ...]) -> Any:
    """Every entry point of every installed distribution (`_path` only keys the cache)."""
    return entry_points()


def _path_state() -> tuple[tuple[str, int], ...]:
    """sys.path with each entry's modification time (-1 where there is none to read)."""
    out = []
    for p in sys.path:
        try:
            out.append((p, os.stat(p or ".").st_mtime_ns))
        except OSError:
            out.append((p, -1))
    return tuple(out)


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
        for ep in group_entries(g):
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
    matches = [ep for ep in group_entries(OPTIONS_GROUP) if ep.name == f"{group}.{name}"]
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
    matches = [ep for ep in group_entries(group) if ep.name == name]
    if not matches:
        have = ", ".join(sorted({ep.name for ep in group_entries(group)})) or "none"
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

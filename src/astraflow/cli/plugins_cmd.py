"""`astraflow plugins`: list installed plugins per group without importing any."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def plugins(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List installed plugins per entry-point group (reads package metadata only)."""
    from astraflow.plugins import list_plugins

    groups = list_plugins()
    if as_json:
        doc = {
            g: [{"name": p.name, "target": p.target, "distribution": p.distribution} for p in ps]
            for g, ps in groups.items()
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    for group, ps in groups.items():
        typer.echo(f"{group}:")
        if not ps:
            typer.echo("  (none)")
        for p in ps:
            typer.echo(f"  {p.name:<16} {p.target}  [{p.distribution}]")

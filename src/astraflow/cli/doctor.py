"""`astraflow doctor`: a preflight on a node; exit 0 when it is ready."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def doctor(
    recipe: Annotated[str | None, typer.Option("--recipe", help="Recipe this node will run.")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")
    ] = None,
    controller: Annotated[
        str | None, typer.Option("--controller", help="Controller endpoint to ask for its status.")
    ] = None,
    key: Annotated[
        Path | None, typer.Option("--key", help="This node's member key (NAME.key_secret).")
    ] = None,
    controller_key: Annotated[
        Path | None, typer.Option("--controller-key", help="The controller's public key file.")
    ] = None,
    port: Annotated[
        list[int] | None, typer.Option("--port", help="A port this node must bind (repeatable).")
    ] = None,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory (disk and clock checks).")] = Path(
        "."
    ),
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the controller.")] = 3.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
) -> None:
    """Check this node: Python, torch/CUDA, plugins, models, keys, ports, controller, disk, clock."""
    from astraflow.cluster import doctor as d

    findings = [d.check_python()]
    r = None
    if recipe is not None:
        from astraflow.config.load import load_recipe

        r = load_recipe(recipe, set_ or [])
    findings += d.check_torch(d.needs_gpu(r) if r is not None else False)
    if r is not None:
        findings += d.check_plugins(r) + d.check_models(r)
    if key is not None:
        findings.append(d.check_key(key, secret=True))
    if controller_key is not None:
        findings.append(d.check_key(controller_key, secret=False))
    findings += [d.check_port(p) for p in port or []]
    if controller is not None:
        findings.append(
            d.check_controller(controller, key, str(controller_key) if controller_key else None, timeout)
        )
    findings += [d.check_disk(run_dir), d.check_clock(run_dir)]
    typer.echo(d.render(findings, as_json))
    raise typer.Exit(1 if any(f.level == "fail" for f in findings) else 0)

"""`astraflow pack`: a bundle for an air-gapped cluster (wheels, models, data, recipe, checksums)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def pack(
    recipe: Annotated[str | None, typer.Argument(help="Recipe TOML file (not with --check).")] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Bundle directory to write (must not exist).")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")
    ] = None,
    platform: Annotated[
        str, typer.Option("--platform", help="Wheel platform tag of the target.")
    ] = "manylinux_2_28_x86_64",
    python: Annotated[str, typer.Option("--python", help="Python version of the target.")] = "3.11",
    torch: Annotated[str, typer.Option("--torch", help="torch build: cpu, cu124, cu126, ...")] = "cpu",
    torch_version: Annotated[
        str | None, typer.Option("--torch-version", help="torch version (default: the one installed here).")
    ] = None,
    extra: Annotated[
        list[str] | None,
        typer.Option("--extra", help="An astraflow extra to include (repeatable), e.g. math."),
    ] = None,
    torch_index: Annotated[
        str,
        typer.Option(
            "--torch-index",
            help="Extra index for torch's accelerator builds ({accel} is replaced); '' for none "
            "(then torch comes from PyPI or pip's configured find-links).",
        ),
    ] = "https://download.pytorch.org/whl/{accel}",
    no_wheels: Annotated[
        bool, typer.Option("--no-wheels", help="Models, data and recipe only (the cluster has the software).")
    ] = False,
    check_bundle: Annotated[
        Path | None, typer.Option("--check", help="Verify a bundle's checksums instead of packing.")
    ] = None,
) -> None:
    """Write a bundle for an air-gapped cluster, or verify one with --check (exit 1 if damaged)."""
    import re
    import time

    from astraflow import __version__
    from astraflow.cluster import pack as p
    from astraflow.errors import AstraflowError

    if check_bundle is not None:
        _check(check_bundle)
    if recipe is None or out is None:
        raise AstraflowError("pack needs a RECIPE and --out", hint="astraflow pack RECIPE --out BUNDLE")
    if out.exists():
        raise AstraflowError(f"{out} exists", hint="pick a new --out directory")
    if not re.fullmatch(r"cpu|cu\d{3}|rocm[\d.]+", torch):
        raise AstraflowError(f"--torch {torch!r}: expected cpu, cuXYZ or rocmX.Y")
    from astraflow.config.load import load_recipe

    r = load_recipe(recipe, set_ or [])
    if torch_version is None:
        import importlib.metadata

        torch_version = importlib.metadata.version("torch").split("+")[0]
    target = p.Target(platform, python, torch, torch_version)
    work = out.with_name(out.name + ".partial")  # a failed pack leaves no half bundle under --out
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    doc = p.copy_inputs(r, work, Path.cwd())
    import json

    (work / "recipe.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if not no_wheels:
        p.download_wheels(target, extra or [], work / "wheels", torch_index)
    meta = {
        "astraflow": __version__,
        "created": time.time(),
        "target": None
        if no_wheels
        else {"platform": platform, "python": python, "torch": f"{torch_version}+{torch}"},
        "extras": extra or [],
    }
    manifest = p.write_sums(work, meta)
    work.rename(out)
    size = sum(f["size"] for f in manifest["files"].values())
    typer.echo(f"wrote {out}: {len(manifest['files'])} files, {size / 2**20:.0f} MiB")


def _check(bundle: Path) -> None:
    """Verify a bundle's checksums: print each problem and exit 1 if damaged, 0 if intact."""
    from astraflow.cluster import pack as p

    problems = p.check(bundle)
    for line in problems:
        typer.echo(line)
    typer.echo(f"{bundle}: {'damaged' if problems else 'intact'}")
    raise typer.Exit(1 if problems else 0)

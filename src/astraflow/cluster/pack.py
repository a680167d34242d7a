"""`astraflow pack`: one directory that carries a run to an air-gapped cluster, and its check.

Layout of a bundle:
  wheels/            every wheel the target needs (astraflow itself built from this checkout, torch
                     pinned to the named accelerator's build), downloaded for the target's platform
                     and Python by pip, not for this machine's
  models/<dir>/      each policy's model directory, copied
  data/<name>        files and directories the recipe's options name that exist here, copied
  recipe.json        the resolved recipe, its model and data paths pointing into the bundle
  manifest.json      target, versions, and every file with its size and sha256
  SHA256SUMS         the same checksums in `sha256sum -c` format

`pack --check` re-hashes every file and fails on any missing, changed or unlisted one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

SUMS = "SHA256SUMS"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Target:
    """The machine the bundle is for."""

    platform: str
    """A wheel platform tag, e.g. manylinux_2_28_x86_64."""
    python: str
    """Python version, e.g. 3.11."""
    torch: str
    """Accelerator build of torch: cpu, cu124, ..."""
    torch_version: str
    """torch version without its local part (default: the one installed here)."""


def source_root() -> Path:
    """The checkout astraflow runs from (a wheel of it is built from there)."""
    import astraflow

    root = Path(astraflow.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise AstraflowError(
            f"astraflow is not running from a source checkout ({root} has no pyproject.toml)",
            hint="pack from a clone of the repository (pip install -e .)",
        )
    return root


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise AstraflowError(
            f"pip failed: {' '.join(cmd)}\n{out.stderr.strip()[-2000:]}",
            hint="check the target flags and the network to PyPI",
        )


def platform_tags(platform: str) -> list[str]:
    """The tag and every older one a target of that tag installs (pip's --platform takes each exactly):
    manylinux_2_28_x86_64 also runs manylinux_2_17 (manylinux2014) wheels."""
    import re

    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if m is None:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = [f"manylinux_2_{v}_{arch}" for v in range(glibc, 4, -1)]
    return tags + [f"{name}_{arch}" for v, name in legacy.items() if v <= glibc]


def download_wheels(target: Target, extras: list[str], wheels: Path, torch_index: str) -> None:
    """astraflow's wheel and, for the target, every wheel it and the extras need."""
    wheels.mkdir(parents=True, exist_ok=True)
    _pip(["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source_root())])
    [own] = sorted(wheels.glob("astraflow-*.whl"))
    spec = f"{own}[{','.join(extras)}]" if extras else str(own)
    _pip(
        [
            "download",
            "-q",
            "--dest",
            str(wheels),
            "--only-binary=:all:",
            *[a for tag in platform_tags(target.platform) for a in ("--platform", tag)],
            "--python-version",
            target.python,
            *(["--extra-index-url", torch_index.format(accel=target.torch)] if torch_index else []),
            f"torch=={target.torch_version}+{target.torch}",
            spec,
        ]
    )


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def _bundle_paths(options: dict[str, Any], bundle: Path, base: Path) -> dict[str, Any]:
    """Options whose string values name existing files or directories: copied into data/, the
    value pointed at the copy (relative to the bundle)."""
    out = dict(options)
    for key, value in options.items():
        if isinstance(value, str) and value and (base / value).exists() and "/" in value:
            src = (base / value).resolve()
            _copy(src, bundle / "data" / src.name)
            out[key] = f"data/{src.name}"
    return out


def copy_inputs(recipe: Any, bundle: Path, base: Path) -> dict[str, Any]:
    """Copy the models and data the recipe names; returns the resolved recipe pointing at the copies."""
    doc: dict[str, Any] = recipe.model_dump(mode="json")
    for pol in doc["policy"]:
        src = (base / pol["model"]).resolve()
        if not src.is_dir():
            raise AstraflowError(f"policy {pol['name']}: model directory {src} does not exist")
        _copy(src, bundle / "models" / src.name)
        pol["model"] = f"models/{src.name}"
        for stage in pol.get("data", []):
            stage["options"] = _bundle_paths(stage.get("options", {}), bundle, base)
    doc["workflow"]["options"] = _bundle_paths(doc["workflow"].get("options", {}), bundle, base)
    return doc


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(bundle: Path) -> list[Path]:
    return sorted(p for p in bundle.rglob("*") if p.is_file() and p.name not in (SUMS, MANIFEST))


def write_sums(bundle: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file; write SHA256SUMS and manifest.json; returns the manifest."""
    files = {
        str(p.relative_to(bundle)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(bundle)
    }
    (bundle / SUMS).write_text("".join(f"{f['sha256']}  {name}\n" for name, f in files.items()))
    manifest = {**meta, "files": files}
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def check(bundle: Path) -> list[str]:
    """Problems of a bundle against its manifest: missing, changed and unlisted files ([] when intact)."""
    try:
        files = json.loads((bundle / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise AstraflowError(
            f"{bundle} is not a bundle: {exc}", hint="make one with astraflow pack"
        ) from None
    problems = []
    for name, f in files.items():
        p = bundle / name
        if not p.is_file():
            problems.append(f"missing  {name}")
        elif p.stat().st_size != f["size"] or _sha256(p) != f["sha256"]:
            problems.append(f"changed  {name}")
    problems += [
        f"unlisted {p.relative_to(bundle)}" for p in _files(bundle) if str(p.relative_to(bundle)) not in files
    ]
    return problems

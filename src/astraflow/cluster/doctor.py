"""`astraflow doctor`: is this node ready to run its part of a run? One finding per check, each
`ok`, `warn` or `fail`; the node is ready when nothing failed.

The checks read and probe, they change nothing: Python and torch (and CUDA where the recipe asks for
GPUs), the plugins the recipe names (found in package metadata and on the import path, not imported),
model directories and their configs, key files and their modes, ports, the controller (one status
request), free disk in the run directory, and the clock against the run directory's filesystem.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MIN_FREE_GIB = 1.0
"""Below this much free disk in the run directory the node fails the check."""
LOW_FREE_GIB = 10.0
"""Below this much it warns (checkpoints of a real model take several GiB each)."""
MAX_SKEW_S = 5.0
"""Largest tolerated difference between this clock and the run directory's filesystem clock."""


@dataclass(frozen=True)
class Finding:
    """The outcome of one check."""

    check: str
    """What was checked (python, torch, plugin, model, key, port, controller, disk, clock)."""
    level: str
    """ok, warn or fail."""
    message: str
    """One line for people."""


def _ok(check: str, msg: str) -> Finding:
    return Finding(check, "ok", msg)


def _fail(check: str, msg: str) -> Finding:
    return Finding(check, "fail", msg)


def _warn(check: str, msg: str) -> Finding:
    return Finding(check, "warn", msg)


def check_python() -> Finding:
    """Python 3.11 or newer."""
    v = sys.version_info
    text = f"Python {v.major}.{v.minor}.{v.micro} at {sys.executable}"
    return _ok("python", text) if v >= (3, 11) else _fail("python", f"{text}: astraflow needs 3.11 or newer")


def check_torch(needs_gpu: bool) -> list[Finding]:
    """torch importable; CUDA and its devices when the recipe names GPUs."""
    if importlib.util.find_spec("torch") is None:
        return [_fail("torch", "torch is not installed: pip install torch")]
    import torch

    out = [_ok("torch", f"torch {torch.__version__}")]
    if torch.cuda.is_available():
        out.append(_ok("cuda", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
    elif needs_gpu:
        out.append(_fail("cuda", "the recipe names GPUs but CUDA is not available to torch here"))
    else:
        out.append(_ok("cuda", "no CUDA (the recipe names no GPUs)"))
    return out


def recipe_plugins(recipe: Any) -> list[tuple[str, str]]:
    """(group, name) of every plugin the recipe names."""
    named = [("workflows", recipe.workflow.name)]
    for pol in recipe.policy:
        named += [("engines", pol.engine), ("trainers", pol.trainer), ("losses", pol.loss)]
        named += [("data", stage.name) for stage in pol.data]
    named += [("metric_sinks", sink.name) for sink in recipe.metrics.sinks]
    return sorted(set(named))


def extra_modules(dist: str = "astraflow") -> dict[str, str]:
    """Module name -> the extra of `dist` that installs it (from the distribution's metadata)."""
    import importlib.metadata
    import re

    out: dict[str, str] = {}
    try:
        reqs = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return out
    for req in reqs:
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", req)
        if name and extra and extra.group(1) != "dev":
            out.setdefault(name.group(0).lower().replace("-", "_"), extra.group(1))
    return out


def imported_roots(module: str, package: str = "astraflow") -> set[str]:
    """Top-level names of the modules `module` imports anywhere in its code (in functions too),
    following imports within `package` and `package` modules named in strings ("pkg.mod:func", as
    process-pool targets are given); read from the source, nothing imported."""
    import ast

    seen: set[str] = set()
    roots: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                ref = node.value.split(":")[0]
                if ref.startswith(f"{package}.") and ref.replace(".", "").replace("_", "").isalnum():
                    names = [ref]
            for n in names:
                if n.split(".")[0] == package:
                    todo.append(n)
                else:
                    roots.add(n.split(".")[0])
    return roots


def check_plugins(recipe: Any) -> list[Finding]:
    """Each plugin registered and its module findable, and the packages of astraflow's extras that its
    code imports installed; all without importing it."""
    from astraflow import plugins

    extras = extra_modules()
    out = []
    for group, name in recipe_plugins(recipe):
        eps = {ep.name: ep for ep in plugins.group_entries(f"astraflow.{group}")}
        ep = eps.get(name)
        if ep is None:
            out.append(_fail("plugin", f"{group} plugin {name!r} is not installed (no entry point)"))
            continue
        module = ep.value.split(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(_fail("plugin", f"{group} plugin {name!r}: module {module} is not importable here"))
            continue
        missing = sorted(
            (root, extra)
            for root in imported_roots(module)
            if (extra := extras.get(root.lower())) is not None and importlib.util.find_spec(root) is None
        )
        if missing:
            needs = ", ".join(root for root, _ in missing)
            pip = " ".join(sorted({f"'astraflow[{extra}]'" for _, extra in missing}))
            # a warning: the code may import them only on a path the recipe does not take (LoRA, parquet)
            out.append(
                _warn("extra", f"{group} {name}'s code imports {needs}, not installed: pip install {pip}")
            )
        else:
            out.append(_ok("plugin", f"{group} {name} -> {ep.value}"))
    return out


def check_models(recipe: Any) -> list[Finding]:
    """Each policy's model directory exists and holds a readable config.json with a model_type."""
    out = []
    for pol in recipe.policy:
        path = Path(pol.model)
        config = path / "config.json"
        if not path.is_dir():
            out.append(_fail("model", f"policy {pol.name}: model directory {path} does not exist"))
            continue
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            out.append(_fail("model", f"policy {pol.name}: cannot read {config}: {exc}"))
            continue
        if not model_type:
            out.append(_fail("model", f"policy {pol.name}: {config} has no model_type"))
            continue
        weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
        if not weights:
            out.append(_warn("model", f"policy {pol.name}: {path} ({model_type}) holds no weight files"))
        else:
            out.append(
                _ok("model", f"policy {pol.name}: {path} ({model_type}, {len(weights)} weight file(s))")
            )
    return out


def check_key(path: Path, secret: bool) -> Finding:
    """A key file readable, parseable, and (a secret one) readable by its owner only."""
    from astraflow.transport.keys import load_keypair, load_public

    if not path.is_file():
        return _fail("key", f"{path} does not exist")
    try:
        if secret:
            load_keypair(path)
        else:
            load_public(str(path))
    except Exception as exc:
        return _fail("key", f"{path} is not a usable key file: {exc}")
    mode = path.stat().st_mode & 0o777
    if secret and mode & 0o077:
        return _fail("key", f"{path} has mode {mode:o}: others can read a secret key (chmod 600 it)")
    return _ok("key", f"{path} ({'secret' if secret else 'public'}, mode {mode:o})")


def check_port(port: int) -> Finding:
    """The port can be bound on every interface of this node now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            return _fail("port", f"port {port} cannot be bound here: {exc.strerror}")
    return _ok("port", f"port {port} is free")


def check_controller(address: str, key: Path | None, controller_key: str | None, timeout_s: float) -> Finding:
    """The controller answers one status request within timeout_s."""
    from astraflow.errors import AstraflowError
    from astraflow.transport.control_client import ask_status

    creds = None
    try:
        if key is not None and controller_key is not None:
            from astraflow.transport.keys import load_keypair, load_public
            from astraflow.transport.security import MemberCredentials

            creds = MemberCredentials(
                keypair=load_keypair(key), controller_public=load_public(controller_key)
            )
        t0 = time.monotonic()
        doc = ask_status(address, timeout_s=timeout_s, credentials=creds)
    except AstraflowError as exc:
        return _fail("controller", exc.message)
    ms = (time.monotonic() - t0) * 1000
    return _ok("controller", f"{address} answered in {ms:.0f} ms (run {doc.get('run', {}).get('name', '?')})")


def check_disk(run_dir: Path) -> Finding:
    """Free space where the run directory is (or would be)."""
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    msg = f"{free:.1f} GiB free at {probe}"
    if free < MIN_FREE_GIB:
        return _fail("disk", msg)
    return _warn("disk", msg + f" (under {LOW_FREE_GIB:g} GiB)") if free < LOW_FREE_GIB else _ok("disk", msg)


def check_clock(run_dir: Path) -> Finding:
    """This node's clock against the run directory's filesystem (the file server's on a shared one):
    leases and heartbeats are timed across nodes."""
    probe = run_dir
    while not probe.is_dir() and probe != probe.parent:
        probe = probe.parent
    if time.time() < 1.7e9:  # before 2023-11: a clock never set
        return _fail("clock", f"the clock says {time.ctime()}: set it (NTP)")
    path = probe / f".astraflow-clock-{socket.gethostname()}-{os.getpid()}"
    try:
        before = time.time()
        path.write_bytes(b"")
        skew = path.stat().st_mtime - before
    except OSError as exc:
        return _warn("clock", f"cannot write in {probe} to compare clocks: {exc.strerror}")
    finally:
        path.unlink(missing_ok=True)
    msg = f"clock {skew:+.1f}s from the filesystem at {probe}"
    return _ok("clock", msg) if abs(skew) <= MAX_SKEW_S else _fail("clock", msg + " (sync the clocks: NTP)")


def needs_gpu(recipe: Any) -> bool:
    """Whether the recipe names GPUs for any role."""
    return bool(recipe.rollout.gpus) or any(p.trainer_gpus for p in recipe.policy)


def render(findings: list[Finding], as_json: bool) -> str:
    """One line per finding, or a JSON document."""
    if as_json:
        ready = not any(f.level == "fail" for f in findings)
        return json.dumps({"ready": ready, "findings": [asdict(f) for f in findings]}, indent=2)
    return "\n".join(f"{f.level:4}  {f.check:10} {f.message}" for f in findings)

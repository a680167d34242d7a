"""A member that `astraflow up` starts together with its controller, before the controller listens.

Importing torch, transformers and the model's code is most of a member's start-up (seconds of CPU
each). `up` starts the RaaS workers and trainers at the same time as the controller and gives them
the file the controller writes its address to (RUN/controller.addr): each member imports what its
role will need while the controller opens the run's state and binds, then reads the address and
joins as usual. What the member runs is still decided by the controller's Welcome; the imports here
only warm the module cache, so a failure here is left for the real load to report.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path

from astraflow import log
from astraflow.errors import AstraflowError

_log = log.get("member")


def preload(role: str, resolved_recipe: Path) -> None:
    """Import torch, transformers and the plugins and model code the run's recipe names (best effort)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as the roles do, before transformers reads it
    try:
        import torch  # noqa: F401 - the import itself is the warm-up
        import transformers  # noqa: F401

        from astraflow import plugins

        recipe = json.loads(resolved_recipe.read_text())
        for pol in recipe.get("policy", []):
            if role == "raas":
                plugins.load("engines", pol["engine"])
            elif pol.get("trainable", True):
                plugins.load("trainers", pol["trainer"])
            model_type = json.loads((Path(pol["model"]) / "config.json").read_text()).get("model_type")
            if model_type:
                # transformers' layout for its own architectures; another model's code loads as usual later
                importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except Exception as exc:  # the real load after the Welcome reports any problem, with its context
        _log.debug("preload stopped early: %s", exc)


def controller_from_file(addr_file: Path, role: str, timeout_s: float = 300.0) -> str:
    """Warm up, then wait until the controller has written its endpoint to addr_file; returns it."""
    preload(role, addr_file.parent / "recipe.resolved.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            addr = addr_file.read_text().strip()
        except FileNotFoundError:
            addr = ""
        if addr:
            return addr
        time.sleep(0.05)
    raise AstraflowError(
        f"no controller address in {addr_file} after {timeout_s:.0f}s",
        hint="the controller did not start; see its log in the run directory's logs/",
    )

"""The controller's process: open the run's state.db, bind the socket, publish the address, handle
SIGTERM/SIGINT, and serve until the run ends (service.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.config.recipe import Recipe
from astraflow.roles.controller.core import settle_heap
from astraflow.roles.controller.service import Controller
from astraflow.state.store import Store

_log = log.get("controller")


def run_controller(
    recipe: Recipe, run_dir: Path, bind: str | None = None, *, allow_recipe_change: bool = False
) -> int:
    """Run the controller on `run_dir` (resuming its state.db) until SIGTERM/SIGINT or the run's end."""
    from astraflow.transport.server import RouterServer

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store.open(run_dir / "state.db", synchronous=recipe.controller.synchronous)
    server = None
    ctl: Controller | None = None
    try:
        ctl = Controller(recipe, run_dir, store, allow_recipe_change=allow_recipe_change)
        ctl.start()
        settle_heap()
        ctl.loop.settled_members = max(1, len(ctl.members.seen))  # and again as members join (lifecycle)
        server = RouterServer(
            bind or recipe.controller.bind, max_message_bytes=recipe.controller.max_message_bytes
        )

        def on_signal(signum: int, _frame: Any) -> None:
            ctl.loop.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        tmp = run_dir / "controller.addr.tmp"
        tmp.write_text(server.address + "\n")
        tmp.replace(run_dir / "controller.addr")
        _log.info("controller of run %s listening on %s", recipe.run.name, server.address)
        return ctl.serve(server)
    finally:
        if server is not None:
            server.close()
        if ctl is not None:
            ctl.close_archiver()
        store.close()

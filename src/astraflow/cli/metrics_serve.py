"""`astraflow metrics-serve`: the run's status as Prometheus text on `GET /metrics` (a sidecar)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from astraflow.cli.roles import ControllerKeyOpt, KeyOpt
from astraflow.errors import AstraflowError


def metrics_serve(
    bind: Annotated[str, typer.Option("--bind", help="HOST:PORT to serve /metrics on, e.g. 0.0.0.0:9600.")],
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Read the run directory's state.db (no admission room).")
    ] = None,
    controller: Annotated[
        str | None, typer.Option("--controller", help="Ask a live controller (with --key, --controller-key).")
    ] = None,
    key: KeyOpt = None,
    controller_key: ControllerKeyOpt = None,
) -> None:
    """Serve the run's task, worker, demand and policy gauges for Prometheus until stopped (Ctrl-C)."""
    import signal
    import threading

    from astraflow.cli.status import read_status
    from astraflow.metrics.prometheus import serve
    from astraflow.transport.control_client import ask_status, operator_credentials

    if (run_dir is None) == (controller is None):
        raise AstraflowError(
            "give exactly one of --run-dir or --controller",
            hint="astraflow metrics-serve --bind 127.0.0.1:9600 --run-dir runs/<name>-<time>",
        )
    creds = operator_credentials(key, controller_key)

    def fetch() -> dict[str, Any] | None:
        if run_dir is not None:
            return read_status(run_dir)
        return ask_status(controller or "", timeout_s=3.0, credentials=creds)

    server = serve(bind, fetch)
    typer.echo(f"serving http://{bind}/metrics")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()

"""The run's status as Prometheus text (`GET /metrics`), for dashboards and for scaling the RaaS pool
from outside (a Kubernetes HPA or KEDA on `astraflow_slot_demand`).

The numbers come from the status document (docs/status.md), so every gauge here has its meaning
documented there; `astraflow_up` is 0 while the controller does not answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from astraflow.errors import AstraflowError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    """Gauges in the exposition format, each with its HELP and TYPE lines once."""

    def __init__(self, run: str) -> None:
        self.lines: list[str] = []
        self.seen: set[str] = set()
        self.run = run

    def gauge(self, name: str, help_: str, value: float | None, **labels: object) -> None:
        """One sample (skipped when the value is unknown)."""
        if name not in self.seen:
            self.seen.add(name)
            self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        if value is None:
            return
        pairs = ",".join(f'{k}="{_label(v)}"' for k, v in {"run": self.run, **labels}.items())
        self.lines.append(f"{name}{{{pairs}}} {float(value):g}")


def render(doc: dict[str, Any] | None) -> str:
    """The exposition text of one status document (None: the controller did not answer)."""
    run = (doc or {}).get("run", {}).get("name", "")
    out = _Text(run)
    out.gauge("astraflow_up", "1 while the controller answers status requests.", 0 if doc is None else 1)
    if doc is None:
        return "\n".join(out.lines) + "\n"
    demand = doc.get("demand", {})
    for status, n in doc.get("tasks", {}).items():
        out.gauge("astraflow_tasks", "Training tasks in the ledger by status.", n, status=status)
    out.gauge(
        "astraflow_slot_demand",
        "Tasks a worker could lease or holds: the slots the work in the ledger asks for (scale on this /"
        " slots per worker); tasks of a paused policy are not counted.",
        int(demand.get("waiting", demand.get("queued", 0))) + int(demand.get("leased", 0)),
    )
    out.gauge("astraflow_raas_workers", "Alive RaaS workers.", demand.get("raas"))
    out.gauge("astraflow_raas_slots", "Slots the alive RaaS workers offer.", demand.get("slots"))
    out.gauge("astraflow_raas_busy_slots", "Slots holding a lease.", demand.get("busy_slots"))
    out.gauge("astraflow_raas_idle_fraction", "Share of slots holding no lease.", demand.get("idle_fraction"))
    for w in demand.get("workers", []):
        out.gauge("astraflow_raas_leased", "Leases a RaaS worker holds.", w.get("leased"), member=w.get("id"))
    for pol, room in (demand.get("room") or {}).items():
        out.gauge(
            "astraflow_admission_room", "Tasks admission could still queue for the policy.", room, policy=pol
        )
    for pol, pace in (demand.get("pace") or {}).items():
        out.gauge(
            "astraflow_policy_steps_per_minute", "Optimizer steps per minute, recent.", pace, policy=pol
        )
    for p in doc.get("policies", []):
        name = p.get("name")
        out.gauge(
            "astraflow_policy_step", "Optimizer steps the trainer reported.", p.get("step"), policy=name
        )
        out.gauge(
            "astraflow_policy_version", "Newest published weight version.", p.get("version"), policy=name
        )
        out.gauge(
            "astraflow_policy_reward_mean",
            "Mean reward of the newest step's batch.",
            p.get("reward_mean"),
            policy=name,
        )
    counts: dict[tuple[str, str], int] = {}
    for m in doc.get("members", []):
        key = (str(m.get("role")), str(m.get("status")))
        counts[key] = counts.get(key, 0) + 1
    for (role, status), n in sorted(counts.items()):
        out.gauge("astraflow_members", "Members by role and status.", n, role=role, status=status)
    for pol, b in doc.get("buffers", {}).items():
        for status, n in b.items():
            out.gauge(
                "astraflow_trajectories", "Trajectories by policy and status.", n, policy=pol, status=status
            )
    return "\n".join(out.lines) + "\n"


def serve(bind: str, fetch: Callable[[], dict[str, Any] | None]) -> ThreadingHTTPServer:
    """Serve `GET /metrics` on HOST:PORT from a daemon thread; each request renders what `fetch`
    returns then (None: the controller does not answer). Call `.shutdown()` to stop it."""
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise AstraflowError(
            f"--metrics-bind {bind!r} is not HOST:PORT", hint="e.g. 127.0.0.1:9600 or 0.0.0.0:9600"
        )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            try:
                doc = fetch()
            except AstraflowError:
                doc = None
            body = render(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the hook's signature
            return

    try:
        server = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
    except OSError as exc:
        raise AstraflowError(f"cannot serve /metrics on {bind}: {exc}", hint="pick a free port") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server

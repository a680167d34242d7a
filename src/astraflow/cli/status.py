"""`astraflow status`: policies, members and task counts, from a run directory or a live controller."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from astraflow.errors import AstraflowError
from astraflow.transport.control_client import ask_status


def read_status(run_dir: Path) -> dict[str, Any]:
    """The status document read from a run directory's state.db (read-only; safe while running)."""
    from astraflow.state.status import build_status
    from astraflow.state.store import Store

    db = run_dir / "state.db"
    if not db.is_file():
        raise AstraflowError(
            f"no state.db in {run_dir}", hint="pass the run directory of a run (runs/<name>-<time>/)"
        )
    store = Store.open_readonly(db)
    try:
        return build_status(store)
    finally:
        store.close()


def render(doc: dict[str, Any]) -> str:
    """A short human-readable rendering of the status document."""
    lines = []
    for p in doc.get("policies", []):
        lines += _policy_lines(p)
    paused = doc.get("control", {}).get("paused", [])
    if paused:
        lines.append("admission paused: " + ("the whole run" if "*" in paused else ", ".join(paused)))
    stall = doc.get("stall")
    if stall:
        stopped = f", run stopped ({stall['failed']})" if "failed" in stall else ""
        lines.append(f"stalled for {stall.get('idle_s', 0):.0f}s{stopped}:")
        lines += [f"  {k}: {v}" for k, v in stall.get("waits", {}).items()]
    t = doc.get("tasks", {})
    lines.append("tasks: " + " ".join(f"{k}={v}" for k, v in t.items()))
    by_reason = doc.get("failures", {}).get("by_reason", {})
    if by_reason:
        lines.append("failed attempts: " + " ".join(f"{k}={v}" for k, v in sorted(by_reason.items())))
        last = doc["failures"].get("last_error", "")
        if last:
            lines.append("last error: " + last.strip().splitlines()[-1][:200])
    for m in doc.get("members", []):
        lines.append(
            f"member {m['id']}: {m['role']} {m['status']} policies={','.join(m.get('policies', []))}"
        )
    return "\n".join(lines)


def _policy_lines(p: dict[str, Any]) -> list[str]:
    """One policy's line (its step, version and reward, or frozen) and its skipped steps."""
    rm = p.get("reward_mean")
    rtxt = "-" if rm is None else f"{rm:.3f}"
    if p.get("trainable", True):
        budget = f"/{p['budget']}" if p.get("budget") else ""
        done = " (finished)" if p.get("finished") else ""
        lines = [f"policy {p['name']}: step {p['step']}{budget} version {p['version']} reward {rtxt}{done}"]
    else:
        lines = [f"policy {p['name']}: frozen, version {p['version']}"]
    skipped = p.get("skipped_steps") or []
    if skipped:
        shown = ", ".join(str(k) for k in skipped[-5:])
        n = len(skipped)
        lines.append(
            f"  {n} step{'s' if n != 1 else ''} skipped by the trainer (non-finite loss or gradient norm): {shown}"
        )
    return lines


def status(
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory to read.")] = None,
    controller: Annotated[
        str | None, typer.Option("--controller", help="Live controller endpoint to ask.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the status document as JSON (schema: docs/status.md).")
    ] = False,
    key: Annotated[
        Path | None, typer.Option("--key", help="Key file (NAME.key_secret) for an authenticated controller.")
    ] = None,
    controller_key: Annotated[
        str | None, typer.Option("--controller-key", help="The controller's public key (file or Z85 text).")
    ] = None,
) -> None:
    """Show a run's policies (version, step, reward), members and task ledger counts."""
    if (run_dir is None) == (controller is None):
        raise AstraflowError(
            "give exactly one of --run-dir or --controller",
            hint="astraflow status --run-dir runs/<name>-<time>",
        )
    if run_dir is not None:
        doc = read_status(run_dir)
    else:
        from astraflow.cli.roles import member_credentials

        doc = ask_status(controller or "", credentials=member_credentials(key, controller_key))
    typer.echo(json.dumps(doc, indent=2, sort_keys=True) if as_json else render(doc))

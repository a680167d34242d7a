"""`astraflow bench control`'s table as text (bench/control.py measures it)."""

from __future__ import annotations

from typing import Any


def render(res: dict[str, Any]) -> str:
    """The bench's table as text."""
    cols = [
        ("members", "members"),
        ("curve", "curve"),
        ("results", "results"),
        ("round", "round"),
        ("sequences_per_s", "seq/s"),
        ("sequences_vs_first", "vs first"),
        ("steps_per_s", "steps/s"),
        ("controller_cpu_pct", "ctl CPU %"),
        ("controller_cpu_ms_per_step", "CPU ms/step"),
        ("main_ms_per_step", "main ms"),
        ("zmq_io_ms_per_step", "zmq I/O ms"),
        ("main_preempted_per_s", "preempted/s"),
        ("cpu_steal_pct", "steal %"),
        ("cpu_irq_pct", "irq %"),
        ("task_ms_p50", "task p50 ms"),
        ("task_ms_p99", "task p99 ms"),
        ("batch_ms_p50", "batch p50 ms"),
        ("batch_ms_p99", "batch p99 ms"),
        ("heartbeats_per_s", "beats/s"),
        ("acks_per_s", "acks/s"),
        ("idle_beats_per_s_told", "idle told/s"),
        ("alive_after", "alive"),
        ("members_declared_dead", "died"),
        ("controller_rss_mb", "RSS MB"),
        ("rss_kb_per_extra_member", "KB/member"),
        ("last_step", "steps"),
        ("state_db_mb", "state.db MB"),
        ("trajectories_in_db", "rows in db"),
        ("archive_mb", "archive MB"),
    ]
    lines = ["  ".join(h for _, h in cols)]
    for r in res["rows"]:
        lines.append("  ".join(str(r.get(k)) for k, _ in cols))
        if r["refused"] or r["errors"] or r["joined"] < r["members"]:
            lines.append(
                f"    joined {r['joined']}/{r['members']}, refused {r['refused']} {r['first_refusals']} "
                f"errors {r['errors']}"
            )
    for md in res.get("medians") or []:
        lines.append(
            f"median of {md['rounds']} rounds: {md['members']} members, CURVE {'on' if md['curve'] else 'off'}, "
            f"{md['results']}: {md['sequences_per_s']:,.0f} seq/s, ratio {md['ratio_median']} (rounds {md['ratios']})"
        )
    lim = res["limits"]
    lines.append(
        f"physical limits here: raw ZeroMQ + msgpack {lim['zmq_msgpack_msgs_per_s']:,} msgs/s; SQLite WAL "
        f"{lim['rows_per_s_batched']:,} rows/s batched, {lim['rows_per_s_one_per_txn']:,} rows/s one per transaction"
    )
    pinned = res.get("controller_cpu")
    where = "" if pinned is None else f", the controller alone on CPU {pinned}, the simulators on the others"
    idle = res.get("idle_siblings") or []
    if idle:
        where += f" but {', '.join(map(str, idle))} (its core's SMT siblings, left idle)"
    lines.append(f"machine: {res['cpus']} CPUs{where}, load average {res['load_avg']:.1f} at the end")
    return "\n".join(lines)

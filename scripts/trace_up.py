"""Where `astraflow up`'s wall and CPU time go: start-up, steps, shutdown (Linux; docs/benchmarks.md).

    python scripts/trace_up.py RUN_DIR [--steps 3] [--recipe recipes/quickstart/recipe.toml] [-- UP_ARGS...]

Runs `astraflow up RECIPE --no-dash --run-dir RUN_DIR --set run.steps=N` with this interpreter, samples
/proc every 50 ms for the launcher and each of its descendants (when each appeared and was last seen,
its user + system CPU), and notes the CPU each had used when the first and the last step appeared in
metrics.jsonl. It prints the wall time, the steps' wall-clock ends (from metrics.jsonl) relative to
the launch, and per process the CPU seconds spent before the first step, during the steps and after
the last step. To time another checkout's code, put its src/ first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def proc_table() -> dict[int, tuple[int, float, list[str]]]:
    """pid -> (parent pid, user + system CPU seconds, command line) of every readable process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = (Path("/proc") / entry / "stat").read_text()
            cmd = (Path("/proc") / entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, cmd)
    return out


def role_of(cmd: list[str]) -> str:
    """A short name for an astraflow process from its command line."""
    if "--member-id" in cmd:
        return cmd[cmd.index("--member-id") + 1]
    for role in ("controller", "up"):
        if role in cmd:
            return role
    return ""


def steps_in(path: Path) -> int:
    """Step rows in metrics.jsonl so far."""
    try:
        return sum(1 for line in path.read_text().splitlines() if '"step"' in line)
    except FileNotFoundError:
        return 0


def main() -> int:
    """Run and report (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recipe", default="recipes/quickstart/recipe.toml")
    ap.add_argument("up_args", nargs="*", help="more `astraflow up` arguments (after --)")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "astraflow", "up", a.recipe, "--no-dash", "--run-dir", str(a.run_dir)]
    cmd += ["--set", f"run.steps={a.steps}", *a.up_args]
    metrics = a.run_dir / "metrics.jsonl"
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with open(str(a.run_dir) + ".out", "wb") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        seen: dict[int, dict[str, object]] = {}
        at_first: dict[int, float] = {}
        at_last: dict[int, float] = {}
        while p.poll() is None:
            now = time.time() - t0
            table = proc_table()
            tree = {p.pid}
            for pid in sorted(table):  # parents usually have lower pids; repeat to catch the rest
                if table[pid][0] in tree:
                    tree.add(pid)
            for pid in sorted(table, reverse=True):
                if table[pid][0] in tree:
                    tree.add(pid)
            for pid in tree & table.keys():
                row = seen.setdefault(pid, {"name": "", "start": now})
                row["name"] = row["name"] or role_of(table[pid][2])
                row["end"], row["cpu"] = now, table[pid][1]
            n = steps_in(metrics)
            if n >= 1 and not at_first:
                at_first = {pid: float(r["cpu"]) for pid, r in seen.items()}  # type: ignore[arg-type]
            if n >= a.steps and not at_last:
                at_last = {pid: float(r["cpu"]) for pid, r in seen.items()}  # type: ignore[arg-type]
            time.sleep(0.05)
    wall = time.time() - t0
    ends = [float(r["time"]) - t0 for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    print(
        f"wall {wall:.2f} s  first step ends {ends[0]:.2f}  last step ends {ends[-1]:.2f}  "
        f"last step -> exit {wall - ends[-1]:.2f}  exit {p.returncode}  "
        f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    totals = [0.0, 0.0, 0.0]
    for pid, row in sorted(seen.items(), key=lambda kv: float(kv[1]["start"])):  # type: ignore[arg-type]
        cpu = float(row["cpu"])  # type: ignore[arg-type]
        first, last = at_first.get(pid, 0.0), at_last.get(pid, at_first.get(pid, 0.0))
        parts = (first, last - first, cpu - last)
        totals = [t + x for t, x in zip(totals, parts, strict=True)]
        print(
            f"  {str(row['name']) or '?':13} alive {float(row['start']):6.2f} -> {float(row['end']):6.2f}"  # type: ignore[arg-type]
            f"  CPU s before first step {parts[0]:5.2f}  steps {parts[1]:5.2f}  after last {parts[2]:5.2f}"
        )
    print(
        f"  {'all':13} {'':24}  CPU s before first step {totals[0]:5.2f}  steps {totals[1]:5.2f}  after last {totals[2]:5.2f}"
    )
    return p.returncode


if __name__ == "__main__":
    raise SystemExit(main())

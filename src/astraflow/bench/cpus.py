"""Where a bench's processes run: the CPUs of one physical core (SMT siblings, read from sysfs) and
the CPUs `bench control` gives its simulators when the controller has a CPU of its own."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0,8", "4-5,12-13") as a set; ValueError on anything else."""
    out: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def core_mates(cpu: int) -> set[int]:
    """The CPUs that share `cpu`'s physical core (its SMT siblings, `cpu` itself included), read from
    sysfs; {cpu} where the kernel does not say."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        return cpu_list(text) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def simulator_cpus(controller_cpu: int) -> set[int]:
    """The CPUs the simulators run on when the controller has `controller_cpu`: every CPU of this
    process but those of the controller's physical core (an SMT sibling busy with simulators would
    slow the controller by sharing its core's execution units: the core is the controller's alone),
    or, where no other CPU is left, every CPU but the controller's own."""
    allowed = set(os.sched_getaffinity(0))
    apart = allowed - core_mates(controller_cpu)
    return apart or allowed - {controller_cpu}


def idle_siblings(controller_cpu: int) -> list[int]:
    """The controller's SMT siblings that `simulator_cpus` leaves idle."""
    return sorted(core_mates(controller_cpu) - {controller_cpu} - simulator_cpus(controller_cpu))


_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks(cpu: int) -> dict[str, int]:
    """One CPU's time so far by kind, in clock ticks, from /proc/stat ({} where it cannot be read)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split()
        if parts and parts[0] == f"cpu{cpu}":
            return dict(zip(_FIELDS, map(int, parts[1:9]), strict=False))
    return {}


def cpu_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float | None]:
    """The share of the CPU's time between two `cpu_ticks` readings that the hypervisor took
    (`steal`, time the virtual CPU did not run at all) and that interrupts took (`irq`: hard and
    soft), in percent; None where a reading is missing."""
    if not before or not after:
        return {"cpu_steal_pct": None, "cpu_irq_pct": None}
    spent = {k: after.get(k, 0) - before.get(k, 0) for k in _FIELDS}
    total = sum(spent.values())
    if total <= 0:
        return {"cpu_steal_pct": None, "cpu_irq_pct": None}
    return {
        "cpu_steal_pct": round(100 * spent["steal"] / total, 1),
        "cpu_irq_pct": round(100 * (spent["irq"] + spent["softirq"]) / total, 1),
    }

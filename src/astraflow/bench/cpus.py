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

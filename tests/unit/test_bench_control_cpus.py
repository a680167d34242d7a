"""bench control's CPU placement: with --controller-cpu the simulators stay off the controller's whole
physical core (its SMT siblings too), so its core is the controller's alone."""

from __future__ import annotations

import os

import pytest

from astraflow.bench import cpus


def test_cpu_list_reads_the_kernels_formats() -> None:
    assert cpus.cpu_list("0\n") == {0}
    assert cpus.cpu_list("0,8") == {0, 8}
    assert cpus.cpu_list("4-5,12-13") == {4, 5, 12, 13}
    with pytest.raises(ValueError):
        cpus.cpu_list("zero")


def test_core_mates_hold_the_cpu_itself() -> None:
    assert 0 in cpus.core_mates(0)
    assert cpus.core_mates(100_000) == {100_000}  # no such CPU: the kernel says nothing


def test_simulators_keep_off_the_controllers_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(cpus, "core_mates", lambda cpu: {cpu, cpu + 8})  # 8 cores, 2 threads each
    assert cpus.simulator_cpus(0) == set(range(1, 16)) - {8}
    assert cpus.idle_siblings(0) == [8]


def test_a_core_of_two_threads_alone_still_leaves_the_sibling(monkeypatch: pytest.MonkeyPatch) -> None:
    # nothing left apart from the controller's core: the simulators share it rather than not run
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(cpus, "core_mates", lambda cpu: {0, 1})
    assert cpus.simulator_cpus(0) == {1}
    assert cpus.idle_siblings(0) == []


def test_cpu_ticks_read_a_cpu_of_this_machine() -> None:
    ticks = cpus.cpu_ticks(min(os.sched_getaffinity(0)))
    assert set(ticks) >= {"user", "system", "idle", "steal"} and ticks["idle"] + ticks["user"] > 0
    assert cpus.cpu_ticks(100_000) == {}


def test_cpu_shares_are_of_the_window() -> None:
    before = dict.fromkeys(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), 0)
    after = {**before, "user": 60, "idle": 20, "irq": 5, "softirq": 5, "steal": 10}
    assert cpus.cpu_shares(before, after) == {"cpu_steal_pct": 10.0, "cpu_irq_pct": 10.0}
    assert cpus.cpu_shares({}, after) == {"cpu_steal_pct": None, "cpu_irq_pct": None}
    assert cpus.cpu_shares(before, before)["cpu_steal_pct"] is None
